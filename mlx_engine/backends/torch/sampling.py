"""Sampling on the torch backend's device, for plain samplers (`Sampler.plain`: no logit bias, no penalties).

The shared sampler runs in MLX on the host: with a CUDA model it would bring every row's logits to the host
and draw there, where MLX's CPU backend's categorical draw is slow (its `exp` and `log`): at a large batch the
sampling alone cost several of the GPU's whole decode steps (docs/benchmarks/code-figures.md, "Measurements moved out of
the code"). Here the same distribution is drawn on the device:

- greedy rows: the argmax (the first maximum, as MLX's);
- the others: `Sampler._filtered`'s rule in torch (temperature first, then the top-k, top-p over the top-k
  survivors, and min-p thresholds, ties kept), then the Gumbel-max draw argmax(z + g), g = -log(-log(u)),
  u uniform from a torch.Generator per request seeded with its seed, so a seeded request repeats on this
  backend (its draws differ from the MLX backend's, whose key stream is MLX's).
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch

TINY = 1e-20  # u in [0, 1): keeps -log(-log(u)) finite


def filtered(z: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """(n, V) temperature-scaled logits -> the same with filtered tokens at -inf (`Sampler._filtered`)."""
    thr = None  # (n, 1): keep z >= thr
    if top_p < 1.0:
        s = torch.topk(z, top_k, dim=-1).values if top_k else torch.sort(z, dim=-1, descending=True).values
        p = torch.softmax(s, dim=-1)  # renormalised over the top-k survivors
        mass_before = torch.cumsum(p, dim=-1) - p  # mass ranked strictly above each token
        n_keep = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp_min(1)
        thr = torch.gather(s, -1, n_keep - 1)
    elif top_k:
        thr = torch.topk(z, top_k, dim=-1).values[:, -1:]
    if min_p > 0.0:
        t = z.max(dim=-1, keepdim=True).values + math.log(min_p)
        thr = t if thr is None else torch.maximum(thr, t)
    return z if thr is None else torch.where(z >= thr, z, torch.full_like(z, -math.inf))


def gumbel_draw(z: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """(n, V) filtered logits, (n, V) uniforms in [0, 1) -> (n,) int64 tokens ~ softmax(z)."""
    return torch.argmax(z - torch.log(-torch.log(uniform.clamp_min(TINY))), dim=-1)


_GENERATORS: weakref.WeakKeyDictionary[Any, torch.Generator] = weakref.WeakKeyDictionary()  # a request's own stream


def _generator(sampler: Any, device: torch.device) -> torch.Generator:
    g = _GENERATORS.get(sampler)
    if g is None or g.device != device:
        g = _GENERATORS[sampler] = torch.Generator(device=device)
        g.manual_seed(sampler.seed)
    return g


def sample_rows(logits: torch.Tensor, samplers: list[Any]) -> torch.Tensor:
    """(n, V) logits on the device, plain samplers -> (n,) int64 tokens on the device. Rows sharing a
    temperature and filters are filtered together; each row draws its own uniforms."""
    logits = logits.float()
    out = torch.argmax(logits, dim=-1)  # the greedy rows' tokens (and a placeholder for the others)
    groups: dict[tuple[float, int, float, float], list[int]] = {}
    for i, s in enumerate(samplers):
        if not s.greedy:
            groups.setdefault((s.temperature, s.top_k, s.top_p, s.min_p), []).append(i)
    for (temperature, top_k, top_p, min_p), idx in groups.items():
        z = logits[idx] / temperature if temperature != 1.0 else logits[idx]
        z = filtered(z, top_k, top_p, min_p)
        uniform = torch.stack([torch.rand(z.shape[-1], generator=_generator(samplers[i], z.device), device=z.device)
                               for i in idx])
        out[idx] = gumbel_draw(z, uniform)
    return out
