"""The compiled decode step's attention (`model.paged_attention`, what `paths.compiled.CompiledHalves` traces into its
graphs) against each cache view's eager attention, on the views' own slots (`paged_rows`): a batched decode step
of sequences of different lengths, a prefill chunk after cached positions (a speculative verification), both
packed into one forward, and the contiguous buffer of the compile's warm-up. Eager torch ops here, so no
compile: what the graphs run is these ops, fused."""

from __future__ import annotations

import pytest

from tests.support.torch_support import require

torch = require("torch")

from mlx_engine.backends.torch.kv import (  # noqa: E402
    ContiguousLayer,
    DecodeStep,
    DecodeView,
    PackedRows,
    PackedView,
    PrefillSlots,
    PrefillView,
    TorchKVStorage,
)
from mlx_engine.backends.torch.model import paged_attention  # noqa: E402

HQ, HKV, D, BS = 6, 2, 8, 4
SCALE = D**-0.5
# float32 sums in another order (einsum and softmax against SDPA's kernel): measured 2.4e-7 on these inputs
ATOL = 2e-6


def _storage(seed: int) -> TorchKVStorage:
    st = TorchKVStorage(1, 8, BS, HKV, D, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    st.k[0].copy_(torch.randn(st.k[0].shape, generator=g))
    st.v[0].copy_(torch.randn(st.v[0].shape, generator=g))
    return st


def _slot(table: list[int], p: int) -> int:
    return table[p // BS] * BS + p % BS


def _qkv(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, HQ, n, D, generator=g), torch.randn(1, HKV, n, D, generator=g),
            torch.randn(1, HKV, n, D, generator=g))


def _both(make_view, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same forward's attention, eagerly through the view and through `paged_attention` on its rows, each on
    its own copy of the pools (both write the new K/V first)."""
    q, k, v = _qkv(n, seed)
    eager_view, paged_view = make_view(_storage(seed)), make_view(_storage(seed))
    rows = paged_view.paged_rows(n, (HKV, D), torch.float32)
    got = paged_attention(q, k, v, rows, SCALE)
    want = eager_view.attention(*_view_layout(eager_view, q, k, v), SCALE)
    if isinstance(eager_view, DecodeView):  # (B, Hq, 1, D) -> the packed rows' (1, Hq, B, D)
        want = want[:, :, 0].transpose(0, 1)[None]
    assert torch.equal(rows.pool_k, eager_view_pool(eager_view)), "the rows' K must be written where the view's are"
    return got, want


def _view_layout(view, q, k, v):
    if isinstance(view, DecodeView):  # a decode step's view takes (B, H, 1, D)
        return tuple(x[0].transpose(0, 1)[:, :, None] for x in (q, k, v))
    return q, k, v


def eager_view_pool(view) -> torch.Tensor:
    if isinstance(view, DecodeView):
        return view.step.storage.k[0]
    if isinstance(view, PackedView):
        return (view.decode.step.storage if view.decode is not None else view.prefills[0].storage).k[0]
    return view.storage.k[0]


TABLES = [[0, 1], [2], [3, 4, 5]]
POSITIONS = [5, 2, 9]  # the new token's position in each sequence: 6, 3 and 10 keys to attend


def _decode(storage: TorchKVStorage) -> DecodeView:
    step = DecodeStep(storage, POSITIONS, [_slot(t, p) for t, p in zip(TABLES, POSITIONS)], TABLES)
    return DecodeView(step, 0)


def _prefill(storage: TorchKVStorage, offset: int = 3, n: int = 4, table: list[int] = (6, 7)) -> PrefillView:
    table = list(table)
    slots = PrefillSlots(storage.device, [_slot(table, p) for p in range(offset, offset + n)],
                         [_slot(table, p) for p in range(offset + n)], table)
    return PrefillView(storage, 0, offset, slots)


@pytest.mark.parametrize("batch", [1, 3])
def test_decode_rows(batch):
    def make(storage):
        step = DecodeStep(storage, POSITIONS[:batch], [_slot(t, p) for t, p in zip(TABLES, POSITIONS)][:batch],
                          TABLES[:batch])
        return DecodeView(step, 0)

    got, want = _both(make, batch, 1)
    assert got.shape == (1, HQ, batch, D)
    assert torch.allclose(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("offset,n", [(3, 4), (0, 5), (6, 1)])
def test_prefill_rows_see_their_causal_prefix(offset, n):
    got, want = _both(lambda s: _prefill(s, offset, n), n, 2)
    assert torch.allclose(got, want, atol=ATOL, rtol=0)


def test_packed_decode_and_prefill_rows():
    def make(storage):
        decode, prefill = _decode(storage), _prefill(storage)
        return PackedView(decode, 3, [prefill], [4], PackedRows(decode.step, [prefill.slots]))

    got, want = _both(make, 3 + 4, 3)
    assert torch.allclose(got, want, atol=ATOL, rtol=0)


def test_contiguous_buffer_rows():
    eager, paged = ContiguousLayer(), ContiguousLayer()
    for n, seed in ((5, 4), (1, 5), (2, 6)):  # a prompt, a decode step, a verification of 2
        q, k, v = _qkv(n, seed)
        want = eager.attention(q, k, v, SCALE)
        got = paged_attention(q, k, v, paged.paged_rows(n, (HKV, D), torch.float32), SCALE)
        assert torch.allclose(got, want, atol=ATOL, rtol=0)
    assert eager.offset == paged.offset == 8
    assert torch.equal(eager.keys[:, :8], paged.keys[:, :8])


def test_rows_are_padded_past_one_key_and_row_major():
    """A dim of 1 would be specialized by dynamo (a graph for it alone): one key is padded to two, the second
    unseen; the gather's strides are row-major whatever the view's slicing left (the graphs check strides)."""
    storage = _storage(7)
    step = DecodeStep(storage, [0], [_slot([1], 0)], [[1]])
    rows = DecodeView(step, 0).paged_rows(1, (HKV, D), torch.float32)
    assert rows.gather.shape == (1, 2) and rows.gather.stride() == (2, 1)
    assert rows.bias.tolist() == [[0.0, float("-inf")]]
    q, k, v = _qkv(1, 7)
    out = paged_attention(q, k, v, rows, SCALE)
    assert torch.allclose(out, v.repeat_interleave(HQ // HKV, dim=1), atol=ATOL, rtol=0)  # its one key: its own V
