"""Where each rank's share of a model lies, on paper: the pipeline's layer ranges balanced by parameters, tensor
parallel's checks, the weight and KV bytes each rank holds, and the link's roof (bytes exchanged per token over the
link's bandwidth). No MLX, so `roofline kv` and the bench's front end use it too.

Pipeline order: rank 0 embeds the tokens and hands them to rank 1, which runs the first layer range, then rank 2 ...
rank N-1, and rank 0 runs the last range, the final norm and the head. Every hop is between ring neighbours (MLX's
ring backend sends only to them), and the embedding table is held once even when the head is tied to it.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_engine.api import ModelLoadError, RooflineError

MODES = ("pipeline", "tensor")


def check_mode(mode: object) -> str:
    if mode not in MODES:
        raise RooflineError(f"--distributed {mode!r}: expected pipeline (layer ranges per rank) or tensor (attention "
                            "heads and MLP columns split across ranks)")
    return str(mode)


def pipeline_split(layer_bytes: list[int], rank0_extra: int, num_ranks: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges [start, end), indexed by rank, minimising the largest rank's bytes. The ranges run in
    the order rank 1, 2, ..., N-1, 0; rank 0 also holds `rank0_extra` bytes (embedding, final norm, head)."""
    num_layers = len(layer_bytes)
    if num_layers < num_ranks:
        raise ModelLoadError(f"pipeline parallel over {num_ranks} ranks needs at least {num_ranks} layers; the model "
                             f"has {num_layers}")
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + b)
    inf = float("inf")
    # best[s][i]: the smallest largest-stage bytes putting layers [0, i) on stages 0..s (stage s = rank s + 1 mod N)
    best = [[inf] * (num_layers + 1) for _ in range(num_ranks)]
    cut = [[0] * (num_layers + 1) for _ in range(num_ranks)]
    for i in range(1, num_layers + 1):
        best[0][i] = prefix[i] + (rank0_extra if num_ranks == 1 else 0)
    for s in range(1, num_ranks):
        extra = rank0_extra if s == num_ranks - 1 else 0
        for i in range(s + 1, num_layers + 1):
            for j in range(s, i):  # stage s takes layers [j, i)
                cost = max(best[s - 1][j], prefix[i] - prefix[j] + extra)
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    bounds, i = [], num_layers
    for s in range(num_ranks - 1, 0, -1):
        bounds.append((cut[s][i], i))
        i = cut[s][i]
    bounds.append((0, i))
    stages = bounds[::-1]  # stage order: rank 1, ..., N-1, 0
    return [stages[-1]] + stages[:-1]


def tensor_problem(num_heads: int, num_kv_heads: int, intermediate: int, num_ranks: int, name: str) -> str | None:
    """Why tensor parallelism cannot split this model over `num_ranks` (None: it can)."""
    if num_heads % num_ranks or num_kv_heads % num_ranks:
        return (f"tensor parallel over {num_ranks} ranks splits the attention heads, but {name} has {num_heads} query "
                f"and {num_kv_heads} KV heads, which do not divide by {num_ranks}: use --distributed pipeline")
    if intermediate % num_ranks:
        return (f"tensor parallel over {num_ranks} ranks splits the MLP columns, but {name}'s {intermediate} do not "
                f"divide by {num_ranks}: use --distributed pipeline")
    return None


@dataclass(frozen=True)
class RankShare:
    """One rank's share: its layers [start, end), whether it holds the embedding and the head, its KV heads per
    layer and its weight bytes."""

    rank: int
    layers: tuple[int, int]
    embed: bool
    head: bool
    kv_heads: int
    weight_bytes: int

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]


_LAYER = re.compile(r"(?:^|\.)(?:layers|blk)\.(\d+)\.")


def file_tensor_sizes(ref: str | None) -> dict[str, tuple[int, int]]:
    """Tensor name -> (parameters, bytes as stored), from the GGUF tensor table or the safetensors headers (no
    weights read). Packed MLX weights count their unpacked parameters; scales and biases count none."""
    from mlx_engine.loading import resolve

    path, kind = resolve(ref)
    if kind == "gguf":
        from mlx_engine.loading.gguf_file import read_gguf

        return {t.name: (_count(t.shape), t.nbytes) for t in read_gguf(path).tensors}
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    bits = int((config.get("quantization") or {}).get("bits", 32))
    out: dict[str, tuple[int, int]] = {}
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for k, v in header.items():
            if k == "__metadata__":
                continue
            n = 0 if k.endswith((".scales", ".biases")) else _count(v["shape"]) * (32 // bits if v["dtype"] == "U32"
                                                                                    else 1)
            out[k] = (n, v["data_offsets"][1] - v["data_offsets"][0])
    return out


def _count(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def shares_on_paper(sizes: dict[str, tuple[int, int]], num_layers: int, num_kv_heads: int, mode: str,
                    num_ranks: int) -> list[RankShare]:
    """Each rank's share, from the checkpoint's tensor sizes (`file_tensor_sizes`): split by parameters as a
    live run splits its loaded model (`shard._weight`), each rank's weights in bytes as stored."""
    params, stored = [0] * num_layers, [0] * num_layers
    embed = rest = (0, 0)  # rest: the final norm and an untied head, on rank 0
    for name, (n, nbytes) in sizes.items():
        m = _LAYER.search(name)
        if m and int(m.group(1)) < num_layers:
            params[int(m.group(1))] += n
            stored[int(m.group(1))] += nbytes
        elif "embed_tokens" in name or name.startswith("token_embd"):
            embed = (embed[0] + n, embed[1] + nbytes)
        else:
            rest = (rest[0] + n, rest[1] + nbytes)
    if mode == "pipeline":
        ranges = pipeline_split(params, embed[0] + rest[0], num_ranks)
        return [RankShare(r, (a, b), r == 0, r == 0, num_kv_heads,
                          sum(stored[a:b]) + (embed[1] + rest[1] if r == 0 else 0)) for r, (a, b) in enumerate(ranges)]
    layers = sum(stored) // num_ranks  # every rank embeds its tokens; rank 0 alone runs the head
    return [RankShare(r, (0, num_layers), True, r == 0, num_kv_heads // num_ranks,
                      layers + embed[1] + (rest[1] if r == 0 else 0)) for r in range(num_ranks)]


def bytes_per_token(mode: str, num_ranks: int, num_layers: int, hidden: int, itemsize: int, batch: int,
                    plan_bytes_per_step: float) -> float:
    """Bytes on the link per generated token at `batch` sequences a step. Pipeline: every hop of the ring (rank 0
    to 1, ..., N-1 to 0) carries each token's hidden state once. Tensor: two all-sums a layer, each moving
    2(N-1)/N of the hidden states per rank (a ring all-reduce). Both: the step's plan, shared by its tokens."""
    row = hidden * itemsize
    if mode == "pipeline":
        per_token = num_ranks * row
    else:
        per_token = 2 * num_layers * 2 * (num_ranks - 1) / num_ranks * row
    return per_token + plan_bytes_per_step / batch


def messages_per_step(mode: str, num_ranks: int, num_layers: int) -> int:
    """Messages one decode step waits on in turn: the plan (relayed along N - 1 hops), then the pipeline's N hops
    or the 2 L all-sums of 2 (N - 1) hops each."""
    plan = num_ranks - 1
    return plan + (num_ranks if mode == "pipeline" else 2 * num_layers * 2 * (num_ranks - 1))


def link_roof(link: dict[str, float], mode: str, num_ranks: int, num_layers: int, hidden: int, itemsize: int,
              batch: int, plan_bytes_per_step: float) -> dict[str, float]:
    """tokens/s the link allows at `batch`: by its bandwidth alone (bytes per token / bandwidth), and with each
    message's latency counted (the step's messages go one after another)."""
    per_token = bytes_per_token(mode, num_ranks, num_layers, hidden, itemsize, batch, plan_bytes_per_step)
    bw, lat = link["bandwidth_bytes_s"], link["latency_s"]
    step_s = messages_per_step(mode, num_ranks, num_layers) * lat + batch * per_token / bw
    return {"bytes_per_token": per_token, "bandwidth_roof_tps": bw / per_token, "latency_roof_tps": batch / step_s}


def read_hostfile_peers(text: str) -> list[str]:
    """The ring hostfile mlx.launch writes for each rank (MLX_HOSTFILE: a JSON list, per rank, of "ip:port"
    strings) as one address string per rank."""
    try:
        ranks = json.loads(text) if text.strip() else []
        return [", ".join(map(str, r)) if isinstance(r, list) else str(r) for r in ranks]
    except ValueError:
        return []


def hostfile_text(path: str | None) -> str:
    if not path:
        return ""
    try:
        return Path(path).read_text()
    except OSError:
        return ""
