"""Paged KV storage in MLX: every layer's K and V in one pool of fixed-size blocks, optionally quantized.

Slots are flat: slot = block_id * block_size + offset. A pool is stored as (num_slots, Hkv, D) (or packed
uint32 (num_slots, Hkv, D * bits / 32) with per-group scales and biases; the keys may have other bits than the values,
`key_bits`), head-major (Hkv, num_slots, ..) on MLX's CPU backend, and handed to the decode kernel as
(num_blocks, block_size, Hkv, ...) blocks (`pool`). Writes are scatters into the pool array, which MLX performs in
place when the pool holds the only reference. Attention over the storage is `mlx_engine.attention`'s.

Quantized K and V are stored transformed, exactly (`kv.smoothing`): keys as ((k - m_k) * s) @ H, read by queries
(q / s) @ H (`queries`); values as (v - m_v) @ H, the attention output mapped back by `outputs`.

Per-channel keys (`key_per_channel`, KIVI): a block's keys are quantized per (KV head, channel) over the block's
tokens instead of per token over groups of channels. A few key channels carry large, steady values (RoPE pairs of
large norm, the attention sink's direction); per channel they get their own range, where per token they widen every
group's. Such keys are stored untransformed, and their D scales per head and block fill the block's slots
(`kernels_metal.reference.channel_params`). A block's scales depend on all its tokens, so the keys of a block still
being written stay in float in a small staging pool (`KeyWritePlan`) and the block is re-quantized from them at
every write; a full block's staging is released once its sequence writes past it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from kernels_metal import KVPool
from kernels_metal.reference import channel_codes, channel_params, quantize_channels, unpack_codes
from mlx_engine.kv.config import SUPPORTED_KV_BITS
from mlx_engine.kv.smoothing import KVSmoothing

SUPPORTED_GROUP_SIZES = (32, 64)
INITIAL_BLOCKS = 8


def hadamard(n: int) -> mx.array:
    """The orthonormal Walsh-Hadamard matrix of order n (a power of two), float32: H @ H.T = I."""
    h = mx.ones((1, 1))
    while h.shape[0] < n:
        h = mx.concatenate([mx.concatenate([h, h], axis=1), mx.concatenate([h, -h], axis=1)], axis=0)
    return h / (n ** 0.5)


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, itemsize: int,
                    bits: int | None = None, group_size: int = 64, key_bits: int | None = None,
                    key_per_channel: bool = False) -> int:
    """K and V of one block across all layers (`key_bits`: the keys' bits, None: `bits`)."""
    from mlx_engine.memory import KVShape, kv_bytes

    return kv_bytes(KVShape(num_layers, num_kv_heads, head_dim, 0), block_size, 1, bits, itemsize, group_size,
                    key_bits=key_bits, key_group_size=block_size if key_per_channel else None)


@dataclass
class KeyWritePlan:
    """Where one part of a step writes per-channel keys (`PagedKVStorage.plan_key_writes`), for every layer."""

    stage_rows: mx.array  # (N,) the staging row of each new token
    block_stage_rows: mx.array  # (nb * block_size,) the staging rows of the touched blocks
    block_slots: mx.array  # (nb * block_size,) their pool slots
    valid: mx.array  # (nb,) tokens written in each touched block after this write


class PagedKVStorage:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: mx.Dtype,
        bits: int | None = None,
        group_size: int = 64,
        head_major: bool | None = None,
        key_bits: int | None = None,
        rotation: bool = True,
        key_per_channel: bool = False,
        window: int | None = None,
    ):
        if bits is not None and bits not in SUPPORTED_KV_BITS:
            raise ValueError(f"kv_bits={bits!r}: expected one of {SUPPORTED_KV_BITS} or None")
        if key_bits is not None and (bits is None or key_bits not in SUPPORTED_KV_BITS):
            raise ValueError(f"kv_key_bits={key_bits!r}: expected one of {SUPPORTED_KV_BITS} with kv_bits set, or None")
        if bits is not None and (group_size not in SUPPORTED_GROUP_SIZES or head_dim % group_size):
            raise ValueError(f"kv_group_size={group_size!r}: expected 32 or 64, dividing head_dim {head_dim}")
        if key_per_channel and (bits is None or head_dim % block_size):
            raise ValueError(f"kv_key_per_channel: needs kv_bits set and a block size dividing head_dim {head_dim} "
                             f"(got kv_bits={bits!r}, block_size={block_size})")
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise ValueError(f"window={window!r}: expected None or a positive number of tokens")
        # the sliding window of every layer stored here (a model whose layers differ keeps one storage per kind):
        # the query at position p attends to keys p - window + 1 .. p (`mlx_engine.attention.paged`)
        self.window = window
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.bits, self.group_size = bits, group_size  # bits: the values' (and by default the keys')
        self.key_bits = bits if key_bits is None else key_bits
        self.key_per_channel = key_per_channel
        # per-channel keys: D / block_size scale slots per token hold a block's D channel scales
        self.key_groups = head_dim // (block_size if key_per_channel else group_size)
        # per-channel keys of blocks still being written, in float: staging rows (stage * block_size + offset)
        self.key_stage: list[mx.array] = []
        self._stage_capacity = 0
        self._stages: dict[int, list] = {}  # block id -> [stage index, owner, full after its last write]
        self._free_stages: list[int] = []
        # Quantized keys and values are stored rotated by an orthonormal Hadamard matrix (QuaRot's trick): a few
        # key channels carry outliers (RoPE pairs of large norm), which wreck a 4-bit group's scale; the rotation
        # spreads every channel's energy over the whole head, and q . k is unchanged when q is rotated too
        # (`queries`; values: `outputs` rotates back). Measured on SmolLM2 in docs/benchmarks/kv-cache.md (bench/kv.py,
        # figure 4).
        self.key_rotation = (hadamard(head_dim).astype(dtype)
                             if rotation and bits is not None and head_dim & (head_dim - 1) == 0 else None)
        self.smoothing: KVSmoothing | None = None  # offsets and key scales (`set_smoothing`), quantized KV only
        self._build_transforms()
        # Layout of every pool array: token-major (slots, Hkv, last) is what the Metal kernel reads;
        # head-major (Hkv, slots, last) lets MLX's CPU SDPA read a sequence's run of slots in place, as fast as a
        # contiguous buffer (docs/benchmarks/code-figures.md, "Figures the code's comments used to carry").
        self.head_major = (not mx.metal.is_available()) if head_major is None else head_major
        self.slot_axis = 1 if self.head_major else 0
        # The pool is num_blocks blocks, but memory is committed as blocks are first used: the arrays hold
        # `capacity` blocks and double (up to num_blocks) when a block id past them is handed out. The
        # block manager hands out never-used blocks before evicting cached ones, so a short chat stays small.
        self.capacity = 0
        self.k, self.v = [], []
        self.k_scales = self.k_biases = self.v_scales = self.v_biases = None
        if bits is not None:
            self.k_scales, self.k_biases, self.v_scales, self.v_biases = [], [], [], []
        self.ensure_capacity(min(num_blocks, INITIAL_BLOCKS))

    def _fields(self) -> list[tuple[list[mx.array], int, mx.Dtype]]:
        """(per-layer arrays, last dim, dtype) of every pool."""
        if self.bits is None:
            return [(self.k, self.head_dim, self.dtype), (self.v, self.head_dim, self.dtype)]
        k_packed, v_packed = self.head_dim * self.key_bits // 32, self.head_dim * self.bits // 32
        groups = self.head_dim // self.group_size
        return [(self.k, k_packed, mx.uint32), (self.v, v_packed, mx.uint32), (self.k_scales, self.key_groups, self.dtype),
                (self.k_biases, self.key_groups, self.dtype), (self.v_scales, groups, self.dtype),
                (self.v_biases, groups, self.dtype)]

    def ensure_capacity(self, num_blocks: int) -> None:
        """Makes block ids < num_blocks addressable, growing the arrays by doubling."""
        if num_blocks <= self.capacity:
            return
        new = min(self.num_blocks, max(num_blocks, 2 * self.capacity))
        extra = (new - self.capacity) * self.block_size
        for arrays, last, dtype in self._fields():
            for layer in range(self.num_layers):
                shape = (self.num_kv_heads, extra, last) if self.head_major else (extra, self.num_kv_heads, last)
                pad = mx.zeros(shape, dtype)
                if len(arrays) <= layer:
                    arrays.append(pad)
                else:
                    arrays[layer] = mx.concatenate([arrays[layer], pad], axis=self.slot_axis)
        self.capacity = new
        mx.eval(self.arrays())

    def arrays(self) -> list[mx.array]:
        out = self.k + self.v
        if self.bits is not None:
            out += self.k_scales + self.k_biases + self.v_scales + self.v_biases
        return out

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    # --- writes ---

    def _quantize(self, x: mx.array, bits: int) -> tuple[mx.array, mx.array, mx.array]:
        n = x.shape[0]
        q, s, b = mx.quantize(x.reshape(n * self.num_kv_heads, self.head_dim), group_size=self.group_size,
                              bits=bits)
        shape = (n, self.num_kv_heads, -1)
        return q.reshape(shape), s.reshape(shape).astype(self.dtype), b.reshape(shape).astype(self.dtype)

    def read_slots(self, a: mx.array, slots: mx.array | slice) -> mx.array:
        """A pool array's entries at `slots`, token-major (S, Hkv, last)."""
        return a[:, slots].swapaxes(0, 1) if self.head_major else a[slots]

    def write_slots(self, arrays: list[mx.array], layer: int, slots: mx.array | slice, x: mx.array) -> None:
        """x token-major (S, Hkv, last) into the pool array at `slots`."""
        if self.head_major:
            arrays[layer][:, slots] = x.swapaxes(0, 1)
        else:
            arrays[layer][slots] = x

    def set_smoothing(self, smoothing: KVSmoothing | None) -> None:
        """Per-model offsets and key scales of the stored K and V (ignored for unquantized KV). Set before
        anything is written: blocks written under other offsets would read wrongly."""
        if self.bits is None:
            return
        if smoothing is not None:
            want = (self.num_layers, self.num_kv_heads, self.head_dim)
            for name in ("key_offset", "key_scale", "value_offset"):
                if getattr(smoothing, name).shape != want:
                    raise ValueError(f"KV smoothing {name} has shape {getattr(smoothing, name).shape}, expected {want}")
        self.smoothing = smoothing
        self._build_transforms()

    def _build_transforms(self) -> None:
        """Per layer: the keys' (Hkv, D, D) map into storage and the queries' matching map, the offsets."""
        self._key_in = self._query_in = self._key_offset = self._value_offset = None
        if self.bits is None or (self.key_rotation is None and self.smoothing is None):
            return
        D, Hkv = self.head_dim, self.num_kv_heads
        basis = self.key_rotation.astype(mx.float32) if self.key_rotation is not None else mx.eye(D)
        sm = self.smoothing
        self._key_in, self._query_in, self._key_offset, self._value_offset = [], [], [], []
        for layer in range(self.num_layers):
            s = mx.array(sm.key_scale[layer]) if sm is not None else mx.ones((Hkv, D))  # (Hkv, D)
            # ((k - m) * s) @ H = (k - m) @ (diag(s) H); (q / s) @ H = q @ (diag(1/s) H)
            self._key_in.append((s[:, :, None] * basis[None]).astype(self.dtype))  # (Hkv, D, D)
            self._query_in.append(((1 / s)[:, :, None] * basis[None]).astype(self.dtype))
            zero = mx.zeros((Hkv, D))
            self._key_offset.append((mx.array(sm.key_offset[layer]) if sm is not None else zero).astype(self.dtype))
            self._value_offset.append((mx.array(sm.value_offset[layer]) if sm is not None else zero).astype(self.dtype))
        mx.eval(self._key_in, self._query_in, self._key_offset, self._value_offset)
        if self.key_per_channel:  # per-channel keys are stored as they are: no offset, scale or rotation
            self._key_in = self._query_in = self._key_offset = None

    def stored_keys(self, layer: int, k: mx.array) -> mx.array:
        """k (N, Hkv, D) -> what is quantized: ((k - m_k) * s) @ H per KV head."""
        if self._key_in is None:
            return k
        x = (k - self._key_offset[layer].astype(k.dtype)).swapaxes(0, 1)  # (Hkv, N, D)
        return (x @ self._key_in[layer].astype(k.dtype)).swapaxes(0, 1)

    def stored_values(self, layer: int, v: mx.array) -> mx.array:
        """v (N, Hkv, D) -> what is quantized: (v - m_v) @ H."""
        if self._value_offset is None:
            return v
        v = v - self._value_offset[layer].astype(v.dtype)
        return v if self.key_rotation is None else v @ self.key_rotation.astype(v.dtype)

    def queries(self, layer: int, q: mx.array) -> mx.array:
        """q (B, Hq, L, D) -> the queries that read the stored keys: (q / s) @ H per KV head (q itself for
        unquantized KV). Scores differ from q . k by q . m_k, the same for every key: the softmax is unchanged."""
        if self._query_in is None:
            return q
        B, Hq, L, D = q.shape
        Hkv = self.num_kv_heads
        qg = q.reshape(B, Hkv, Hq // Hkv * L, D)  # a KV head's queries together
        return (qg @ self._query_in[layer].astype(q.dtype)).reshape(B, Hq, L, D)

    def outputs(self, layer: int, out: mx.array) -> mx.array:
        """Attention output over the stored values, (B, Hq, L, D) -> over the true values: @ H.T + m_v."""
        if self._value_offset is None:
            return out
        B, Hq, L, D = out.shape
        Hkv = self.num_kv_heads
        if self.key_rotation is not None:
            out = out @ self.key_rotation.T.astype(out.dtype)  # the values' rotation (the keys' may be off)
        m = self._value_offset[layer].astype(out.dtype)  # (Hkv, D)
        return (out.reshape(B, Hkv, Hq // Hkv, L, D) + m[None, :, None, None, :]).reshape(B, Hq, L, D)

    def write(self, layer: int, slots: mx.array, k: mx.array, v: mx.array,
              key_plan: KeyWritePlan | None = None) -> None:
        """slots (N,) int32; k, v (N, Hkv, D). Per-channel keys need the step's `plan_key_writes`."""
        if self.bits is None:
            self.write_slots(self.k, layer, slots, k.astype(self.dtype))
            self.write_slots(self.v, layer, slots, v.astype(self.dtype))
            return
        vq, vs, vb = self._quantize(self.stored_values(layer, v), self.bits)
        if self.key_per_channel:
            if key_plan is None:
                raise ValueError("per-channel keys are written with a plan_key_writes plan")
            self._write_channel_keys(layer, key_plan, k)
            pairs = ((self.v, vq), (self.v_scales, vs), (self.v_biases, vb))
        else:
            kq, ks, kb = self._quantize(self.stored_keys(layer, k), self.key_bits)
            pairs = ((self.k, kq), (self.k_scales, ks), (self.k_biases, kb), (self.v, vq), (self.v_scales, vs),
                     (self.v_biases, vb))
        for arrays, x in pairs:
            self.write_slots(arrays, layer, slots, x)

    # --- per-channel keys: staging ---

    def plan_key_writes(self, writes: list[tuple[str, int]]) -> KeyWritePlan | None:
        """Before a forward that writes the (owner request, slot) pairs, in position order per owner: where each
        layer's `write` stages the new keys and which blocks it re-quantizes. None for per-token keys.

        A block written from its first slot starts afresh; one written from a later slot without staging (a
        copied block, or one whose staging was released) is staged from its quantized keys first. An owner's
        full blocks that this write does not touch are released."""
        if not self.key_per_channel:
            return None
        bs = self.block_size
        span: dict[int, list[int]] = {}  # block -> [first offset, last offset, owner]
        for owner, slot in writes:
            block, off = divmod(slot, bs)
            if block in span:
                span[block][1] = off
            else:
                span[block] = [off, off, owner]
        owners = {o for o, _ in writes}
        for block, (_, owner, full) in list(self._stages.items()):
            if full and owner in owners and block not in span:
                self._release_stage(block)
        for block, (first, last, owner) in span.items():
            entry = self._stages.get(block)
            if entry is None:
                entry = self._stages[block] = [self._take_stage(), owner, False]
                if first > 0:
                    self._stage_from_pool(block, entry[0])
            entry[1], entry[2] = owner, last == bs - 1
        stage_rows = [self._stages[s // bs][0] * bs + s % bs for _, s in writes]
        blocks = list(span)
        rows = [self._stages[b][0] * bs + i for b in blocks for i in range(bs)]
        return KeyWritePlan(mx.array(stage_rows, dtype=mx.int32), mx.array(rows, dtype=mx.int32),
                            mx.array([b * bs + i for b in blocks for i in range(bs)], dtype=mx.int32),
                            mx.array([span[b][1] + 1 for b in blocks], dtype=mx.int32))

    def release(self, req_id: str | None) -> None:
        """What a request keeps beyond its blocks: per-channel keys' staging (None: every request's)."""
        self.release_key_stages(req_id)

    def format_stats(self) -> dict[str, Any]:
        return {"kv_bits": self.bits, "kv_key_bits": self.key_bits, "kv_key_per_channel": self.key_per_channel,
                # per-channel keys: float copies of the blocks being written (one per running sequence), outside
                # the budget
                "bytes_staging": sum(a.nbytes for a in self.key_stage)}

    def release_key_stages(self, owner: str | None = None) -> None:
        """Drops the staging of `owner`'s blocks (a finished request), or of every block."""
        for block, entry in list(self._stages.items()):
            if owner is None or entry[1] == owner:
                self._release_stage(block)

    def _release_stage(self, block: int) -> None:
        self._free_stages.append(self._stages.pop(block)[0])

    def _take_stage(self) -> int:
        if not self._free_stages:  # grow by doubling, as the pool does
            new = max(4, 2 * self._stage_capacity)
            shape = ((new - self._stage_capacity) * self.block_size, self.num_kv_heads, self.head_dim)
            # one array per layer: writes update an array in place
            self.key_stage = [mx.concatenate([s, mx.zeros(shape, self.dtype)]) for s in self.key_stage] \
                if self.key_stage else [mx.zeros(shape, self.dtype) for _ in range(self.num_layers)]
            mx.eval(self.key_stage)
            self._free_stages = list(range(new - 1, self._stage_capacity - 1, -1))
            self._stage_capacity = new
        return self._free_stages.pop()

    def _stage_from_pool(self, block: int, stage: int) -> None:
        """A block's quantized keys, every layer, into its staging rows (rows written next are overwritten)."""
        bs = self.block_size
        run = slice(block * bs, (block + 1) * bs)
        for layer in range(self.num_layers):
            self.key_stage[layer][stage * bs:(stage + 1) * bs] = self._channel_keys(layer, run, 1).astype(self.dtype)

    def _write_channel_keys(self, layer: int, plan: KeyWritePlan, k: mx.array) -> None:
        """Stages the new keys k (N, Hkv, D), then re-quantizes every touched block from its staging rows."""
        self.key_stage[layer][plan.stage_rows] = k.astype(self.dtype)
        nb = plan.valid.shape[0]
        x = self.key_stage[layer][plan.block_stage_rows].reshape(nb, self.block_size, self.num_kv_heads,
                                                                  self.head_dim)
        packed, scales, biases = quantize_channels(x, plan.valid, self.key_bits)
        n = nb * self.block_size
        for arrays, a in ((self.k, packed), (self.k_scales, scales), (self.k_biases, biases)):
            self.write_slots(arrays, layer, plan.block_slots, a.reshape(n, self.num_kv_heads, -1))

    def _channel_keys(self, layer: int, slots: slice | mx.array, num_blocks: int) -> mx.array:
        """Per-channel keys of `num_blocks` whole blocks (a slice of slots from a block's start, or (nb * bs,) ids
        of whole blocks in order), dequantized: token-major (nb * bs, Hkv, D) float32."""
        bs, Hkv = self.block_size, self.num_kv_heads
        codes = unpack_codes(self.read_slots(self.k[layer], slots), self.key_bits)  # (nb * bs, Hkv, D)
        s, z = (channel_params(self.read_slots(a[layer], slots).reshape(num_blocks, bs, Hkv, -1))
                for a in (self.k_scales, self.k_biases))  # (nb, Hkv, D)
        return (codes.reshape(num_blocks, bs, Hkv, -1) * s[:, None] + z[:, None]).reshape(num_blocks * bs, Hkv, -1)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src's slots -> block dst's slots, in every layer."""
        if not pairs:
            return
        for _, dst in pairs:  # a copy gets the source's keys: staging left from the block's last owner is stale
            if dst in self._stages:
                self._release_stage(dst)
        bs = self.block_size
        src = mx.array([s * bs + i for s, _ in pairs for i in range(bs)], dtype=mx.int32)
        dst = mx.array([d * bs + i for _, d in pairs for i in range(bs)], dtype=mx.int32)
        for arrays in (self.k, self.v, self.k_scales, self.k_biases, self.v_scales, self.v_biases):
            if arrays is None:
                continue
            for layer in range(self.num_layers):
                self.write_slots(arrays, layer, dst, self.read_slots(arrays[layer], src))

    # --- reads ---

    def gather(self, layer: int, slots: mx.array | slice, whole_blocks: bool = False) -> tuple[mx.array, mx.array]:
        """K, V at `slots` ((S,) ids, or a slice for a contiguous run from a block's start) -> head-major
        (Hkv, S, D) each, dequantized to the storage dtype (a view of the pool for a head-major slice). Quantized
        K and V come back as stored (module docstring): attend with `queries(layer, q)`, map the output with
        `outputs`. `whole_blocks`: the ids are whole blocks in order (per-channel keys read cheaper)."""

        def take(a: mx.array) -> mx.array:
            return a[:, slots] if self.head_major else a[slots].swapaxes(0, 1)

        if self.bits is None:
            return take(self.k[layer]), take(self.v[layer])

        def deq(q: mx.array, s: mx.array, b: mx.array, bits: int) -> mx.array:
            return mx.dequantize(take(q), take(s), take(b), group_size=self.group_size,
                                 bits=bits).astype(self.dtype)

        values = deq(self.v[layer], self.v_scales[layer], self.v_biases[layer], self.bits)
        if self.key_per_channel:
            return self._gather_channel_keys(layer, slots, whole_blocks).astype(self.dtype), values
        return deq(self.k[layer], self.k_scales[layer], self.k_biases[layer], self.key_bits), values

    def _gather_channel_keys(self, layer: int, slots: mx.array | slice, whole_blocks: bool) -> mx.array:
        """`gather`'s keys for per-channel keys: head-major (Hkv, S, D) float32."""
        bs = self.block_size
        if isinstance(slots, slice):
            if slots.start % bs:
                raise ValueError(f"a run of per-channel keys starts at a block's first slot, not {slots.start}")
            n = slots.stop - slots.start
            nb = -(-n // bs)
            return self._channel_keys(layer, slice(slots.start, slots.start + nb * bs), nb)[:n].swapaxes(0, 1)
        if whole_blocks:
            return self._channel_keys(layer, slots, slots.shape[0] // bs).swapaxes(0, 1)
        # any ids: each token's block's scale slots
        S, Hkv = slots.shape[0], self.num_kv_heads
        rows = ((slots // bs) * bs)[:, None] + mx.arange(bs)[None, :]  # (S, bs)
        s, z = (channel_params(self.read_slots(a[layer], rows.reshape(-1)).reshape(S, bs, Hkv, -1))
                for a in (self.k_scales, self.k_biases))  # (S, Hkv, D)
        return (unpack_codes(self.read_slots(self.k[layer], slots), self.key_bits) * s + z).swapaxes(0, 1)

    def gather_runs(self, layer: int, slots: mx.array | list[slice], dtype: mx.Dtype
                    ) -> tuple[list[mx.array], list[mx.array]]:
        """`gather` of each run ((S,) ids count as one) -> lists of (1, Hkv, S_i, D) K and V in `dtype`, for
        `sdpa`'s segments: a slice of a head-major pool is read in place, with no copy of the sequence."""
        runs = slots if isinstance(slots, list) else [slots]
        pairs = [self.gather(layer, r) for r in runs]
        return [k[None].astype(dtype) for k, _ in pairs], [v[None].astype(dtype) for _, v in pairs]

    def pool(self, layer: int) -> KVPool:
        """One layer's pools as the decode kernel reads them: token-major blocks (capacity, block_size, Hkv, ..)
        (a head-major pool is copied into that layout: for references and tests, not a hot path)."""

        def blocked(xs: list[mx.array] | None) -> mx.array | None:
            if xs is None:
                return None
            a = xs[layer].swapaxes(0, 1) if self.head_major else xs[layer]
            return a.reshape(self.capacity, self.block_size, *a.shape[1:])

        return KVPool(blocked(self.k), blocked(self.v), blocked(self.k_scales), blocked(self.k_biases),
                      blocked(self.v_scales), blocked(self.v_biases), self.bits, self.group_size,
                      None if self.key_bits == self.bits else self.key_bits, self.key_per_channel)
