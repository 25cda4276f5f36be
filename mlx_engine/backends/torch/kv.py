"""Paged KV in torch tensors under the shared block bookkeeping (`kv.tables.BlockTables`), through the
`kv.protocol.KVCache` contract.

Every layer's K and V are token-major pools (num_slots, Hkv, D), slot = block_id * block_size + offset,
the layout `triton_kernels.paged_decode_attention` reads. Views are what a model layer sees of the cache
in one forward: they give the new tokens' positions and do attention, writing the new K/V first.
Two attention paths with one contract: the reference (gather the sequence's slots, torch SDPA with a
causal or padding mask), used on the CPU and for prefill; the Triton paged decode kernel on CUDA.
"""

from __future__ import annotations

import functools
import math
import mmap
from typing import Any

import torch
import torch.nn.functional as F

from mlx_engine.api import RooflineError
from mlx_engine.backends.torch.model import PagedRows, causal_attention, chunk_rows, rows_of
from mlx_engine.kv.block_pool import BlockPool
from mlx_engine.kv.config import DEFAULT_MEMORY_FRACTION, KVConfig, blocks_in_budget, default_budget
from mlx_engine.kv.manager import KVCacheManager
from mlx_engine.kv.paged import bytes_per_block
from mlx_engine.kv.protocol import KVCapabilities
from mlx_engine.kv.tables import BlockTableCache, BlockTables

INITIAL_BLOCKS = 8


class TorchKVStorage:
    bits = None  # unquantized (kv_bits is refused on this backend)

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, use_kernel: bool = False, mapped: bool | None = None):
        self.use_kernel = use_kernel  # decode through triton_kernels.paged_decode_attention (CUDA)
        # host pools as anonymous maps of the whole context (`_zero_pages`; default on the CPU), else pools of
        # torch.zeros that double as block ids are used (a device's memory is taken when allocated, not when written)
        self.mapped = device.type == "cpu" if mapped is None else mapped
        if self.mapped and device.type != "cpu":
            raise RooflineError(f"mapped KV pools are host memory; this storage is on {device.type}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype, self.device = num_kv_heads, head_dim, dtype, device
        self.capacity = 0  # blocks addressable now; grows by doubling up to num_blocks as block ids are used
        # mapped: the whole context's pools now, resident only where written, so growing copies nothing
        self.k: list[torch.Tensor] = [self._mapped_pool() for _ in range(num_layers)] if self.mapped else []
        self.v: list[torch.Tensor] = [self._mapped_pool() for _ in range(num_layers)] if self.mapped else []
        self.ensure_capacity(min(num_blocks, INITIAL_BLOCKS))

    def ensure_capacity(self, num_blocks: int) -> None:
        """Pools of capacity + 1 blocks: the last one is `scratch_block`, never handed out by the block pool
        (its ids stay below capacity), where a CUDA graph's padding rows write (`graphs.DecodeGraphs`)."""
        if num_blocks <= self.capacity:
            return
        new = min(self.num_blocks, max(num_blocks, 2 * self.capacity))
        if not self.mapped:
            with torch.inference_mode(False):  # normal tensors wherever they grow: the compiled step guards their kind
                self._grow(new, self.capacity * self.block_size)
        self.capacity = new

    def _mapped_pool(self) -> torch.Tensor:
        with torch.inference_mode(False):  # a normal tensor, as the grown pools are
            return _zero_pages(((self.num_blocks + 1) * self.block_size, self.num_kv_heads, self.head_dim), self.dtype)

    def _grow(self, new: int, used: int) -> None:
        for pools in (self.k, self.v):
            for layer in range(self.num_layers):
                grown = torch.zeros((new + 1) * self.block_size, self.num_kv_heads, self.head_dim, dtype=self.dtype,
                                    device=self.device)
                if len(pools) <= layer:
                    pools.append(grown)
                else:
                    grown[:used] = pools[layer][:used]
                    pools[layer] = grown

    @property
    def scratch_block(self) -> int:
        return self.capacity

    @property
    def nbytes(self) -> int:
        """The pools' addressable bytes: capacity + 1 blocks a pool (on the CPU the mapping is the whole context's,
        but a page of it is memory only once a slot on it is written)."""
        slots = (self.capacity + 1) * self.block_size
        return 2 * self.num_layers * slots * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def release(self, req_id: str | None) -> None:
        pass  # nothing kept beside the blocks

    def format_stats(self) -> dict[str, Any]:
        return {"kv_bits": None, "kv_key_bits": None, "kv_key_per_channel": False, "bytes_staging": 0}

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots (N,) int64; k, v (N, Hkv, D)."""
        self.k[layer][slots] = k.to(self.dtype)
        self.v[layer][slots] = v.to(self.dtype)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src's slots -> block dst's slots, in every layer."""
        bs = self.block_size
        src = torch.tensor([s * bs + i for s, _ in pairs for i in range(bs)], device=self.device)
        dst = torch.tensor([d * bs + i for _, d in pairs for i in range(bs)], device=self.device)
        for pools in (self.k, self.v):
            for pool in pools:
                pool[dst] = pool[src]

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slots (..., S) -> K, V (..., Hkv, S, D). index_select on the flat slots: on the CPU 2.5x faster than
        advanced indexing (a decode step of SmolLM2 gathers 60 times)."""
        flat = slots.reshape(-1)
        return tuple(pool.index_select(0, flat).view(*slots.shape, *pool.shape[1:]).transpose(-3, -2)
                     for pool in (self.k[layer], self.v[layer]))


def _zero_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor on an anonymous memory map: the kernel's zero pages until written, so what is resident
    is the blocks handed out so far (never more than the capacity's), and unmapped when the tensor goes. Pools of
    torch.zeros that double zeroed the grown half at once, copied the used half and left the outgrown pools as
    holes in malloc's heap (SmolLM2 Q4_0, a 1,100-token prompt: 8-13 MB more peak RSS; docs/benchmarks/torch-cpu.md)."""
    count = math.prod(shape)
    pages = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)


class PrefillSlots:
    """A prefill chunk's slots, shared by its layers' views: host lists, device tensors made on first use (a
    chunk replayed as a CUDA graph never makes them)."""

    def __init__(self, device: torch.device, new: list[int], all_slots: list[int], table: list[int]):
        self.device, self.new_list, self.all_list, self.table = device, new, all_slots, table

    @functools.cached_property
    def new(self) -> torch.Tensor:
        return torch.tensor(self.new_list, device=self.device)  # (L,)

    @functools.cached_property
    def all(self) -> torch.Tensor:
        return torch.tensor(self.all_list, device=self.device)  # (offset + L,)

    @functools.cached_property
    def rows(self) -> tuple[torch.Tensor, ...]:
        """`PagedRows`' (write, gather, bias) of the chunk's rows: row i sees positions <= offset + i."""
        return chunk_rows(self.new, self.all)


class PrefillView:
    """One layer's view for a prefill chunk (or a speculative verify) over positions [offset, offset + L)."""

    def __init__(self, storage: TorchKVStorage, layer: int, offset: int, slots: PrefillSlots):
        self.storage, self.layer, self.offset, self.slots = storage, layer, offset, slots

    @property
    def num_new(self) -> int:
        return len(self.slots.new_list)

    def as_decode_step(self) -> DecodeStep:
        """These L positions as a decode step of L rows sharing one block table, row i attending to
        positions <= offset + i: causal prefill through the paged decode kernel (a short speculative
        verification replayed as a CUDA graph)."""
        L, slots = self.num_new, self.slots
        return DecodeStep(self.storage, list(range(self.offset, self.offset + L)), slots.new_list, [slots.table] * L)

    def positions(self, B: int, L: int, device: torch.device) -> torch.Tensor:
        return torch.arange(self.offset, self.offset + L, device=device).expand(B, L)

    def has_paged_rows(self, batch: int) -> bool:
        return batch == 1

    def paged_rows(self, n: int, kv_shape: tuple[int, int], dtype: torch.dtype) -> PagedRows:
        return PagedRows(self.storage.k[self.layer], self.storage.v[self.layer], *self.slots.rows)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q (1, Hq, L, D), k/v (1, Hkv, L, D) after rope -> (1, Hq, L, D)."""
        self.storage.write(self.layer, self.slots.new, k[0].transpose(0, 1), v[0].transpose(0, 1))
        keys, values = self.storage.gather(self.layer, self.slots.all)  # (Hkv, S, D)
        return causal_attention(q, keys[None].to(q.dtype), values[None].to(q.dtype), self.offset, scale)


class DecodeStep:
    """What every layer's view shares in one decode step of B sequences (one new token each). The step keeps
    its host lists; its device tensors are made on first use, so a CUDA graph's replay (which copies the lists
    into its own static tensors, `graphs.DecodeGraphs`) never makes them."""

    def __init__(self, storage: TorchKVStorage, positions: list[int], new_slots: list[int], tables: list[list[int]]):
        self.storage, self.use_kernel = storage, storage.use_kernel
        self.position_list, self.slot_list, self.tables = positions, new_slots, tables

    @classmethod
    def static(cls, storage: TorchKVStorage, positions: torch.Tensor, new_slots: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor) -> DecodeStep:
        """A step over given device tensors (a CUDA graph's static inputs); the kernel path only."""
        step = cls(storage, [], [], [])
        step.__dict__.update(positions=positions, new_slots=new_slots, block_tables=block_tables, seq_lens=seq_lens)
        step.use_kernel = True
        return step

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        return torch.tensor(self.position_list, device=self.storage.device)[:, None]  # (B, 1)

    @functools.cached_property
    def new_slots(self) -> torch.Tensor:
        return torch.tensor(self.slot_list, device=self.storage.device)  # (B,)

    @functools.cached_property
    def block_tables(self) -> torch.Tensor:
        width = max(len(t) for t in self.tables)
        return torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32,
                            device=self.storage.device)  # (B, nb)

    @functools.cached_property
    def seq_lens(self) -> torch.Tensor:
        return torch.tensor([p + 1 for p in self.position_list], dtype=torch.int32, device=self.storage.device)

    @functools.cached_property
    def slots(self) -> torch.Tensor:
        """The reference path: every sequence's slots, padded to the longest (B, S)."""
        S, bs = max(self.position_list) + 1, self.storage.block_size
        slots = self.block_tables.long()[:, :, None] * bs + torch.arange(bs, device=self.storage.device)
        return slots.flatten(1)[:, :S]

    @functools.cached_property
    def rows(self) -> tuple[torch.Tensor, ...]:
        """`PagedRows`' (write, gather, bias) of the step: row b sees its own sequence's positions."""
        S = max(self.position_list) + 1
        visible = torch.arange(S, device=self.storage.device)[None, :] < self.seq_lens[:, None]
        return rows_of(self.new_slots, self.slots, visible)

    @functools.cached_property
    def mask(self) -> torch.Tensor | None:
        if len(self.position_list) == 1:
            return None
        S = max(self.position_list) + 1
        return (torch.arange(S, device=self.storage.device)[None, :] < self.seq_lens[:, None])[:, None, None, :]


class DecodeView:
    def __init__(self, step: DecodeStep, layer: int):
        self.step, self.layer = step, layer

    def positions(self, B: int, L: int, device: torch.device) -> torch.Tensor:
        return self.step.positions

    def has_paged_rows(self, batch: int) -> bool:
        return not self.step.use_kernel

    def paged_rows(self, n: int, kv_shape: tuple[int, int], dtype: torch.dtype) -> PagedRows:
        storage = self.step.storage
        return PagedRows(storage.k[self.layer], storage.v[self.layer], *self.step.rows)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q (B, Hq, 1, D), k/v (B, Hkv, 1, D) after rope -> (B, Hq, 1, D)."""
        st, storage = self.step, self.step.storage
        storage.write(self.layer, st.new_slots, k[:, :, 0], v[:, :, 0])
        if st.use_kernel:
            from mlx_engine.backends.torch import triton_kernels

            out = triton_kernels.paged_decode_attention(q[:, :, 0], storage.k[self.layer], storage.v[self.layer],
                                                        st.block_tables, st.seq_lens, scale, storage.block_size)
            return out[:, :, None]
        keys, values = storage.gather(self.layer, st.slots)  # (B, Hkv, S, D)
        return F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=st.mask,
                                              scale=scale, enable_gqa=True)


class PackedView:
    """One layer's view of a forward over packed rows (1, T) of several sequences (`kv.views.PackedView`'s rows:
    one decode row per decoding sequence, then each prefill chunk's), for the torch model, which ropes from
    per-row positions (asked of layer 0's view, once a forward) and then calls `attention`."""

    def __init__(self, decode: DecodeView | None, num_decode: int, prefills: list[PrefillView], lengths: list[int],
                 rows: PackedRows | None = None):
        self.decode, self.num_decode, self.prefills = decode, num_decode, prefills
        starts = [num_decode + sum(lengths[:i]) for i in range(len(lengths))]
        self.spans = [(a, a + n) for a, n in zip(starts, lengths)]
        self.rows = rows or PackedRows(decode.step if decode is not None else None, [p.slots for p in prefills])

    def has_paged_rows(self, batch: int) -> bool:
        return self.decode is None or self.decode.has_paged_rows(batch)

    def paged_rows(self, n: int, kv_shape: tuple[int, int], dtype: torch.dtype) -> PagedRows:
        view = self.decode if self.decode is not None else self.prefills[0]
        storage, layer = view.step.storage if self.decode is not None else view.storage, view.layer
        return PagedRows(storage.k[layer], storage.v[layer], *self.rows.rows)

    def positions(self, B: int, L: int, device: torch.device) -> torch.Tensor:
        parts = [self.decode.step.positions[:, 0]] if self.decode is not None else []
        parts += [torch.arange(view.offset, view.offset + hi - lo, device=device)
                  for view, (lo, hi) in zip(self.prefills, self.spans)]
        return torch.cat(parts)[None]  # (1, T)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q (1, Hq, T, D), k/v (1, Hkv, T, D) after rope -> (1, Hq, T, D)."""
        outs = []
        b = self.num_decode
        if self.decode is not None:
            qd, kd, vd = (x[0, :, :b].transpose(0, 1)[:, :, None] for x in (q, k, v))  # (B, H, 1, D)
            outs.append(self.decode.attention(qd, kd, vd, scale)[:, :, 0].transpose(0, 1)[None])  # (1, Hq, B, D)
        for view, (lo, hi) in zip(self.prefills, self.spans):
            outs.append(view.attention(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], scale))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


class PackedRows:
    """`PagedRows`' (write, gather, bias) of a packed forward, shared by its layers' views: the decode step's rows,
    then each prefill chunk's, their gathers padded to the longest with unseen slots."""

    def __init__(self, step: DecodeStep | None, chunks: list[PrefillSlots]):
        self.parts = ([step] if step is not None else []) + chunks

    @functools.cached_property
    def rows(self) -> tuple[torch.Tensor, ...]:
        parts = [p.rows for p in self.parts]
        if len(parts) == 1:
            return parts[0]
        S = max(g.shape[1] for _, g, _ in parts)
        return (torch.cat([w for w, _, _ in parts]), torch.cat([F.pad(g, (0, S - g.shape[1])) for _, g, _ in parts]),
                torch.cat([F.pad(b, (0, S - b.shape[1]), value=-math.inf) for _, _, b in parts]))


MAX_CONTEXTS = 256  # a GPU's default pool holds at most this many full contexts


def gpu_default_budget(free_bytes: int, context_length: int, block_size: int, per_block: int) -> int:
    """Half the GPU's free memory, capped at MAX_CONTEXTS full contexts: on an H200 half the free memory
    would be millions of blocks of a tiny model, a block pool of millions of Python entries (seconds to
    load, gigabytes of host memory) for sequences no scheduler runs at once."""
    contexts = MAX_CONTEXTS * (-(-context_length // block_size)) * per_block
    return min(int(free_bytes * DEFAULT_MEMORY_FRACTION), contexts)


class TorchPagedCache(BlockTableCache):
    """The paged KV cache over torch storage: the shared block bookkeeping (a `BlockTables` it holds, served through
    `BlockTableCache`'s methods), torch views."""

    def __init__(self, storage: TorchKVStorage, manager: KVCacheManager, num_layers: int, bytes_per_block: int):
        self.storage, self.manager, self.num_layers = storage, manager, num_layers
        self.tables = BlockTables(manager, storage, bytes_per_block)
        self.block_size = manager.block_size
        self.capabilities = KVCapabilities(paged=True, batching=True, packed=True, rollback=True, kv_files=False,
                                           prefix_caching=manager.pool.enable_caching, quantized=False)

    @classmethod
    def create_torch(cls, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                     device: torch.device, context_length: int, weight_bytes: int, config: KVConfig,
                     model_id: bytes, use_kernel: bool = False) -> TorchPagedCache:
        config.validate(head_dim)
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_block = bytes_per_block(num_layers, config.block_size, num_kv_heads, head_dim, itemsize)
        budget = config.kv_budget_bytes
        if budget is None:
            if device.type == "cuda":  # a server GPU: room for many sequences, within half the free memory
                budget = gpu_default_budget(int(torch.cuda.mem_get_info(device)[0]), context_length,
                                            config.block_size, per_block)
            else:
                budget = default_budget(context_length, config.block_size, per_block, weight_bytes)
        num_blocks = blocks_in_budget(budget, per_block, config.block_size, num_layers)
        storage = TorchKVStorage(num_layers, num_blocks, config.block_size, num_kv_heads, head_dim, dtype, device,
                                 use_kernel)
        manager = KVCacheManager(BlockPool(num_blocks, enable_caching=config.prefix_caching), config.block_size,
                                 extra_key=model_id)
        return cls(storage, manager, num_layers, per_block)

    def calibrate(self, model: Any, tokenizer: Any, vocab_size: int) -> None:
        pass  # unquantized

    def save(self, path: str, token_ids: list[int], fingerprint: bytes) -> int:
        raise RooflineError("saving KV is not supported on the torch backend")

    def restore(self, path: str, fingerprint: bytes) -> list[int]:
        raise RooflineError("restoring KV is not supported on the torch backend")

    # --- views ---

    def prefill_layers(self, req_id: str, start: int, end: int) -> list[PrefillView]:
        mgr = self.manager
        slots = PrefillSlots(self.storage.device, mgr.slot_mapping(req_id, start, end),
                             mgr.slot_mapping(req_id, 0, end), mgr.block_table(req_id))
        return [PrefillView(self.storage, i, start, slots) for i in range(self.num_layers)]

    def decode_layers(self, req_ids: list[str], known_ids: list[list[int]]) -> list[DecodeView]:
        """Sequence b's next token goes at position num_tokens(b), allocated here."""
        mgr = self.manager
        positions = self.tables.decode_positions(req_ids, known_ids)
        step = DecodeStep(self.storage, positions, [mgr.slot_mapping(r, p, p + 1)[0] for r, p in zip(req_ids, positions)],
                          [mgr.block_table(r) for r in req_ids])
        return [DecodeView(step, i) for i in range(self.num_layers)]

    def packed_layers(self, decode_ids: list[str], known_ids: list[list[int]],
                      chunks: list[tuple[str, int, int]]) -> list[PackedView]:
        """Views for one forward over packed rows: a decode step of `decode_ids` (may be empty), then each
        (req_id, start, end) prefill chunk."""
        decode = self.decode_layers(decode_ids, known_ids) if decode_ids else [None] * self.num_layers
        prefills = [self.prefill_layers(r, a, b) for r, a, b in chunks]
        lengths = [b - a for _, a, b in chunks]
        rows = PackedRows(decode[0].step if decode_ids else None, [p[0].slots for p in prefills])
        return [PackedView(decode[i], len(decode_ids), [p[i] for p in prefills], lengths, rows)
                for i in range(self.num_layers)]

    def state(self, layers: list[Any]) -> list[Any]:
        return []  # torch work is eager: nothing for mx.eval

    def check_kernels(self) -> tuple[str, ...]:
        return ()  # no Metal kernel (the Triton kernel's fallback is `triton_kernels`' own)


class ContiguousLayer:
    """One layer's K/V of one sequence in a growing token-major buffer (B, S, Hkv, D): for forwards outside the
    block pool (the speculative cost probe, a draft model, the compile's warm-up). Trimmable, as mlx-lm's
    KVCache."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.offset = 0

    @property
    def state(self) -> list[Any]:
        return []  # nothing for mx.eval: torch work is eager

    def positions(self, B: int, L: int, device: torch.device) -> torch.Tensor:
        return torch.arange(self.offset, self.offset + L, device=device).expand(B, L)

    def _reserve(self, B: int, L: int, kv_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> int:
        end = self.offset + L
        if self.keys is None or end > self.keys.shape[1]:
            size = max(end, 2 * (self.keys.shape[1] if self.keys is not None else 128))
            with torch.inference_mode(False):  # normal tensors, as the block pool's (`TorchKVStorage`)
                grown = [torch.zeros(B, size, *kv_shape, dtype=dtype, device=device) for _ in range(2)]
                if self.keys is not None:
                    grown[0][:, : self.offset] = self.keys[:, : self.offset]
                    grown[1][:, : self.offset] = self.values[:, : self.offset]
            self.keys, self.values = grown
        return end

    def has_paged_rows(self, batch: int) -> bool:
        return batch == 1

    def paged_rows(self, n: int, kv_shape: tuple[int, int], dtype: torch.dtype) -> PagedRows:
        """The buffer as a pool whose slots are positions."""
        device = self.keys.device if self.keys is not None else torch.device("cpu")
        start, end = self.offset, self._reserve(1, n, kv_shape, dtype, device)
        self.offset = end
        return PagedRows(self.keys[0], self.values[0], *chunk_rows(torch.arange(start, end, device=device),
                                                                   torch.arange(end, device=device)))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        end = self._reserve(k.shape[0], k.shape[2], k.shape[1::2], k.dtype, k.device)
        self.keys[:, self.offset:end] = k.transpose(1, 2)
        self.values[:, self.offset:end] = v.transpose(1, 2)
        out = causal_attention(q, self.keys[:, :end].transpose(1, 2), self.values[:, :end].transpose(1, 2),
                               self.offset, scale)
        self.offset = end
        return out

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n
