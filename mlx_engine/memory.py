"""Will a model fit? The memory this machine can give a model, what the model's weights take once loaded (from
headers alone) and what its KV takes (`kv_bytes`): the numbers `catalog.check_fit` weighs at every load, before it
reads a weight.

"Can give": on a Mac the GPU's recommended working set (what Metal keeps resident without paging); elsewhere
the RAM the kernel says is available, capped by whatever limit this process runs under — the address-space limit
(`ulimit -v`), the data limit (`ulimit -d`) and a cgroup's memory limit (a container). Under `ulimit -v` the
available RAM is not what a process can allocate: MLX's allocator fails inside a kernel and the process dies
with SIGSEGV, so the limit is the figure, not the RAM.
"""

from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


FIT_CONTEXT = 4096  # tokens of KV a model must have room for when no max_context is asked (LM Studio's default)
GB = 1e9


@dataclass(frozen=True)
class MemoryLimit:
    bytes: int
    source: str  # in words: "available RAM", "the address-space limit, ulimit -v", ...


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat_field(path: str, key: str) -> int:
    try:
        for line in Path(path).read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _proc_status_kb(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_headroom() -> int | None:
    """Bytes this process's cgroup may still take (reclaimable page cache counted as free), or None: no limit."""
    limit = _read_int("/sys/fs/cgroup/memory.max")  # v2 (its namespace root, as a container sees it)
    if limit is not None:
        used = _read_int("/sys/fs/cgroup/memory.current") or 0
        return limit - used + _stat_field("/sys/fs/cgroup/memory.stat", "inactive_file")
    limit = _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes")  # v1
    if limit is not None and limit < 2**62:  # v1 writes "no limit" as a huge page-aligned number
        used = _read_int("/sys/fs/cgroup/memory/memory.usage_in_bytes") or 0
        return limit - used + _stat_field("/sys/fs/cgroup/memory/memory.stat", "total_inactive_file")
    return None


def _rlimit_headroom(which: int, current: int | None) -> int | None:
    soft, _ = resource.getrlimit(which)
    if soft == resource.RLIM_INFINITY or current is None:
        return None
    return soft - current


def metal_working_set() -> int | None:
    """The GPU's recommended working set on a Mac (None elsewhere)."""
    # off a Mac, a process that has not imported MLX (the model lister) need not load it to learn there is no
    # Metal; one that has asks MLX, which a simulated Mac (tests/test_engine_mac_path.py) answers
    if sys.platform != "darwin" and "mlx.core" not in sys.modules:
        return None
    import mlx.core as mx

    if not mx.metal.is_available():
        return None
    return int(mx.metal.device_info()["max_recommended_working_set_size"])


def available_memory() -> MemoryLimit:
    """What this process can still allocate for a model: the smallest of the figures that bind it."""
    metal = metal_working_set()
    if metal is not None:
        import mlx.core as mx

        return MemoryLimit(metal - int(mx.get_active_memory()), "the GPU's recommended working set")
    ram = _meminfo_available()
    if ram is None:
        try:
            ram = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            ram = 4 * 2**30
    out = MemoryLimit(ram, "available RAM")
    for value, source in (
        (_rlimit_headroom(resource.RLIMIT_AS, _proc_status_kb("VmSize")), "the address-space limit, ulimit -v"),
        (_rlimit_headroom(resource.RLIMIT_DATA, _proc_status_kb("VmData")), "the data-size limit, ulimit -d"),
        (_cgroup_headroom(), "the cgroup memory limit"),
    ):
        if value is not None and value < out.bytes:
            out = MemoryLimit(max(value, 0), source)
    return out


# ---- what the weights take once loaded -----------------------------------------------------------------

@dataclass(frozen=True)
class WeightsHeader:
    """A checkpoint's tensors by how a loader holds them, from its headers."""

    float_params: int = 0  # unquantized tensors' elements (an MLX checkpoint's scales and biases among them)
    float_bytes: int = 0  # as stored
    packed_bytes: int = 0  # affine-quantized values kept packed: MLX's uint32, GGUF Q4_0 / Q4_1 / Q8_0's
    packed_groups: int = 0  # GGUF Q4_0 / Q4_1 / Q8_0 groups: a scale and a bias each once in MLX
    kquant_params: int = 0  # GGUF k-quant matrices' elements
    kquant_bytes: int = 0  # as stored (blocks)
    checkpoint_itemsize: int = 2  # bytes of the checkpoint's float dtype

    @property
    def stored_bytes(self) -> int:
        return self.float_bytes + self.packed_bytes + 2 * self.packed_groups + self.kquant_bytes


def held_weight_bytes(w: WeightsHeader, backend: str = "mlx", metal: bool | None = None) -> tuple[int, str]:
    """(bytes the weights take once loaded, how they are held). The MLX runner casts float weights to the
    activation dtype (float32 on MLX's CPU backend, the checkpoint's on Metal) and keeps affine-quantized ones
    packed; GGUF k-quants stay blocks on Metal and are dequantized (to that dtype) on the CPU. The torch backend
    is counted at its stored size, the least it can take (its CPU packing is its own)."""
    if backend != "mlx":
        return w.stored_bytes, "as stored"
    if metal is None:
        metal = metal_working_set() is not None
    if metal:
        held = w.float_params * w.checkpoint_itemsize + w.packed_bytes + w.packed_groups * 4 + w.kquant_bytes
        return held, "as stored"
    held = (w.float_params + w.kquant_params) * 4 + w.packed_bytes + w.packed_groups * 8
    how = "float32 on the CPU" + (", k-quants dequantized" if w.kquant_params else "")
    return held, how


# ---- the check before a load ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Fit:
    fits: bool
    weight_bytes: int
    kv_bytes: int
    context: int
    available: MemoryLimit
    how: str

    @property
    def need_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    def refusal(self, name: str) -> str:
        """One line: both figures, and what to try."""
        tips = ["a smaller quantization" + (" (on this CPU k-quants are dequantized; Q4_0, Q8_0 and MLX-quantized "
                                            "weights stay packed)" if "k-quants" in self.how else "")]
        room = self.available.bytes - self.weight_bytes
        if room > 0 and self.kv_bytes and self.context > 256:
            per_token = self.kv_bytes / self.context
            tips.append(f"--max-context {max(256, int(room / per_token) // 256 * 256):,}".replace(",", ""))
            tips.append("--kv-bits 8")
        return (f"{name} does not fit: it needs {self.need_bytes / GB:.2f} GB ({self.weight_bytes / GB:.2f} GB of "
                f"weights, {self.how}, and {self.kv_bytes / GB:.2f} GB of KV for {self.context:,} tokens) but this "
                f"machine can give {self.available.bytes / GB:.2f} GB ({self.available.source}); try "
                + ", ".join(tips[:-1]) + (" or " if len(tips) > 1 else "") + tips[-1])


def estimate_fit(weights: WeightsHeader, kv_per_token: int, model_context: int, *, context: int | None = None,
                 kv_budget_bytes: int | None = None, backend: str = "mlx", extra_bytes: int = 0,
                 available: MemoryLimit | None = None, metal: bool | None = None) -> Fit:
    """Weights plus the KV for `context` tokens (None: FIT_CONTEXT, within the model's own), or `kv_budget_bytes`
    when that is set, against `available` (default: `available_memory()`)."""
    held, how = held_weight_bytes(weights, backend, metal)
    ctx = context or FIT_CONTEXT
    if model_context:
        ctx = min(ctx, model_context)
    kv = kv_budget_bytes if kv_budget_bytes is not None else kv_per_token * ctx
    available = available or available_memory()
    return Fit(held + extra_bytes + kv <= available.bytes, held + extra_bytes, kv, ctx, available, how)


# ---- KV bytes ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    context_length: int
    sliding_window: int | None = None  # tokens a sliding layer attends to
    num_sliding_layers: int = 0  # of num_layers
    num_experts: int = 0  # MoE: experts per layer (0: dense)
    num_experts_per_tok: int = 0
    # MLA (DeepSeek-V3, Kimi K2): what a layer keeps per token is one latent vector of this many elements
    # (kv_lora_rank + qk_rope_head_dim), shared by every head's K and V; 0: K and V per KV head
    latent_dim: int = 0
    v_head_dim: int = 0  # V's head size where it differs from K's (MLA's, were it expanded); 0: head_dim
    # layers that keep no K and V: linear attention, Mamba and convolution layers (a fixed-size recurrent state per
    # sequence) and Nemotron-H's MLP and MoE blocks (nothing)
    no_kv_layers: int = 0
    # full-attention layers whose heads differ from the others' (Gemma 4's `per_layer_config`): how many, their
    # head size and KV heads (0: num_kv_heads)
    wide_layers: int = 0
    wide_head_dim: int = 0
    wide_kv_heads: int = 0
    # the recurrent layers' state per sequence, whatever the context: elements at the activation dtype (convolution
    # windows, Mamba's SSM state) and in float32 (Gated DeltaNet's state, which mlx-lm keeps in float32)
    state_elems: int = 0
    state_f32_elems: int = 0


def kv_bytes(shape: KVShape, context: int, batch: int = 1, kv_bits: int | None = None, itemsize: int = 2,
             group_size: int = 64, key_bits: int | None = None, key_group_size: int | None = None) -> int:
    """K and V of every layer for `batch` sequences of `context` tokens, a sliding layer's at most its window
    (quantized: packed values plus a scale and a bias per group, in the activation dtype). `key_bits`: the keys' bits when they differ
    from the values' `kv_bits` (None: the same). `key_group_size`: the keys' when it differs (per-channel
    keys: a scale and bias per channel and block of that many tokens costs what per-token groups of that
    many channels cost)."""

    def per_vector(dim: int, bits: int | None, group: int) -> int:
        if bits is None:
            return dim * itemsize
        return dim * bits // 8 + 2 * -(-dim // group) * itemsize

    def per_token(k_dim: int, v_dim: int) -> int:  # one head's K and V
        return (per_vector(k_dim, kv_bits if key_bits is None else key_bits, key_group_size or group_size)
                + per_vector(v_dim, kv_bits, group_size))

    if shape.latent_dim:  # one latent per token and layer, no heads, no separate V
        layer = per_vector(shape.latent_dim, kv_bits, group_size)
    else:
        layer = per_token(shape.head_dim, shape.v_head_dim or shape.head_dim) * shape.num_kv_heads
    wide = per_token(shape.wide_head_dim, shape.wide_head_dim) * (shape.wide_kv_heads or shape.num_kv_heads) \
        if shape.wide_layers else 0
    # a sliding layer holds its window's tokens at most
    window = min(context, shape.sliding_window) if shape.sliding_window else context
    full = max(0, shape.num_layers - shape.no_kv_layers - shape.num_sliding_layers - shape.wide_layers)
    return (layer * (full * context + shape.num_sliding_layers * window) + wide * shape.wide_layers * context) * batch


def state_bytes(shape: KVShape, batch: int = 1, itemsize: int = 2) -> int:
    """The recurrent layers' state of `batch` sequences (fixed, whatever their length)."""
    return (shape.state_elems * itemsize + shape.state_f32_elems * 4) * batch


# ---- what this process holds, and handing it back --------------------------------------------------------

@dataclass(frozen=True)
class HeldMemory:
    rss_bytes: int  # the process's resident set (on macOS: its peak, which is what getrusage reports)
    mlx_active_bytes: int  # MLX arrays alive
    mlx_cache_bytes: int  # MLX's buffer cache: freed arrays' memory it keeps for reuse


def held_memory() -> HeldMemory:
    import mlx.core as mx

    rss = _proc_status_kb("VmRSS")
    if rss is None:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return HeldMemory(rss, int(mx.get_active_memory()), int(mx.get_cache_memory()))


def return_memory() -> HeldMemory:
    """After a model is closed: its arrays collected, MLX's buffer cache emptied and (glibc) the heap's free pages
    handed back, so an unloaded model's memory goes back to the system rather than staying with this process.
    Returns what is held afterwards."""
    import gc

    import mlx.core as mx

    gc.collect()  # a closed engine's arrays may sit in reference cycles (tracebacks, closures)
    mx.clear_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    return held_memory()


def _malloc_trim() -> Any:
    import ctypes
    import ctypes.util
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
