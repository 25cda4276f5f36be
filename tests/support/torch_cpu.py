"""What the torch CPU kernels' tests share: the golden llama per GGUF type, greedy agreement, the kernel's code
layouts. Import after `torch_support.require("torch")`."""

from __future__ import annotations

import pytest
import torch

from mlx_engine import Engine, GenerationRequest, SamplingParams
from tests.support.tiny_models import (
    GOLDEN,
    folder_with_weights,
    gguf_to_hf_names,
    kquant_llama_gguf,
    write_gguf_from_folder,
)

PROMPT = [3, 17, 42, 99, 7, 64, 120, 5] * 3
GGUF_KIND = {"Q4_0": "int4", "Q4_1": "int4", "Q8_0": "int4x2", "Q5_0": "int4x2", "Q5_1": "int4x2"}


def greedy(engine: Engine, ids: list[int], n: int = 12) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [t for e in engine.generate(GenerationRequest(prompt_token_ids=ids, sampling=params)) for t in e.token_ids]


@pytest.fixture(scope="module")
def quantized_files(tmp_path_factory):
    """The golden llama as a GGUF of each type (and the random k-quant llama), with a float folder of exactly
    its dequantized weights: {type: (file, float folder)}."""
    pytest.importorskip("gguf")
    tmp = tmp_path_factory.mktemp("packed")
    out = {}
    for t in GGUF_KIND:
        path = tmp / f"tiny_{t}.gguf"
        deq = write_gguf_from_folder(GOLDEN / "llama", path, {}, default_type=t)
        out[t] = (path, folder_with_weights(GOLDEN / "llama", tmp / f"ref_{t}", gguf_to_hf_names(deq)))
    kpath, ksrc, kdeq = kquant_llama_gguf(tmp / "k")
    out["kquants"] = (kpath, folder_with_weights(ksrc, tmp / "ref_k", gguf_to_hf_names(kdeq)))
    from tests.support.loading import _quantized_folder

    (tmp / "mlx4").mkdir()
    out["mlx4"] = _quantized_folder(tmp / "mlx4", bits=4, group_size=32,
                                    override={"model.layers.0.mlp.down_proj": {"bits": 8, "group_size": 32},
                                              "lm_head": {"bits": 4, "group_size": 64}})
    return out


def greedy_agrees(packed: Engine, ref: Engine, ids: list[int], tol: float, n: int = 12,
                  got: list[int] | None = None) -> int:
    """How many greedy tokens `packed` (or `got`) shares with `ref` before they part; where they part, the token
    taken must be within `tol` of `ref`'s at that position (a near-tie that bfloat16 roundings may flip: the
    golden MLX 4-bit folder's first token has a gap of 0.044 between its top two logits of 4.1)."""
    want, got = greedy(ref, ids, n), got if got is not None else greedy(packed, ids, n)
    for i, (w, g) in enumerate(zip(want, got)):
        if w != g:
            logits = ref.forward_logits(ids + want[:i])[-1]
            assert logits[w] - logits[g] <= tol, (i, w, g, logits[w] - logits[g])
            return i
    return n


def pack4(c: torch.Tensor) -> torch.Tensor:
    n, k = c.shape
    b = c.view(n, k // 32, 32) & 15
    return (b[..., :16] | (b[..., 16:] << 4)).reshape(n, k // 2).contiguous()


def pack5(c: torch.Tensor) -> torch.Tensor:
    """5-bit codes (N, K) -> the kernel's bytes: `pack4` of their low 4 bits, then per block the word whose bit j
    is code j's fifth, written out bit by bit here (not as the loader's np.packbits does it)."""
    n, k = c.shape
    fifth = (c.view(n, k // 32, 32).to(torch.int64) >> 4) & 1
    words = (fifth << torch.arange(32)).sum(-1)  # (N, blocks), below 2**32
    le = torch.stack([(words >> (8 * i)) & 255 for i in range(4)], dim=-1).to(torch.uint8).reshape(n, k // 8)
    return torch.cat([pack4(c), le], dim=1).contiguous()


def random_weight(bits, dtype, offsets, K, N=200):
    """Codes (N, K) as integers, the kernel's codes, d and m (empty without offsets)."""
    g = torch.Generator().manual_seed(bits * 10 + (offsets is True) + K)
    if bits in (4, 5):
        c = torch.randint(0, 2**bits, (N, K), generator=g, dtype=torch.uint8)
        codes = pack4(c) if bits == 4 else pack5(c)
    else:
        c = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
        codes = c
    d = (torch.rand(N, K // 32, generator=g) * 0.05 + 1e-3).to(dtype)
    m = (torch.randn(N, K // 32, generator=g) * 0.1).to(dtype) if offsets is True else torch.empty(0, dtype=dtype)
    return c, codes, d, m
