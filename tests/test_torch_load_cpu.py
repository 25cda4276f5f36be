"""The torch backend's load reads a checkpoint tensor by tensor into its packed form (`load_checkpoint(lazy=True)`,
`backends/torch/weights.py`): the same packed weights and logits, bit for bit, as building from the eager load
of every tensor at once, and never more than one source tensor held at a time (a structural property: a load's
peak over a tiny model is too small to measure; bench/torch_cpu_load.py measures SmolLM2's).
"""

from __future__ import annotations

import gc
import importlib
import weakref
from collections.abc import Iterator, MutableMapping
from typing import Any

import numpy as np
import pytest

from tests.support.torch_support import require

torch = require("torch")

import mlx.core as mx  # noqa: E402

from mlx_engine import Engine  # noqa: E402
from mlx_engine.backends.torch.load import cpu_pack_plan  # noqa: E402
from mlx_engine.backends.torch.weights import build_model  # noqa: E402
from mlx_engine.loading import load_checkpoint  # noqa: E402
from mlx_engine.loading.gguf_model import GGUFTensors  # noqa: E402
from tests.support.tiny_models import GOLDEN, kquant_llama_gguf, write_gguf_from_folder  # noqa: E402

CPU = torch.device("cpu")
IDS = [3, 17, 42, 99, 7, 64, 120, 5] * 3  # under every tiny model's vocabulary of 128
GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "F16")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """The golden llama as a GGUF of each type, the random k-quant llama, an MLX 4-bit folder (an 8-bit layer,
    a group of 64) and the float32 / bfloat16 safetensors folders."""
    pytest.importorskip("gguf")
    tmp = tmp_path_factory.mktemp("load")
    out = {}
    for t in GGUF_TYPES:
        write_gguf_from_folder(GOLDEN / "llama", tmp / f"tiny_{t}.gguf", {}, default_type=t)
        out[t] = str(tmp / f"tiny_{t}.gguf")
    out["kquants"] = str(kquant_llama_gguf(tmp / "k")[0])
    from tests.support.loading import _quantized_folder

    (tmp / "mlx4").mkdir()
    out["mlx4"] = str(_quantized_folder(tmp / "mlx4", bits=4, group_size=32, override={
        "model.layers.0.mlp.down_proj": {"bits": 8, "group_size": 32},
        "lm_head": {"bits": 4, "group_size": 64}})[0])
    out["float32"], out["bfloat16"] = str(GOLDEN / "llama"), str(GOLDEN / "llama_bf16")
    return out


def _build(ref: str, lazy: bool, weights_wrapper: Any = None) -> Any:
    ckpt = load_checkpoint(ref, kquant_blocks=True, lazy=lazy)
    args = importlib.import_module(f"mlx_engine.models.{ckpt.config['model_type']}").args_from_config(ckpt.config)
    cpu, _ = cpu_pack_plan(CPU)
    weights = ckpt.weights if weights_wrapper is None else weights_wrapper(ckpt.weights)
    ckpt.weights = {}
    return build_model(args, weights, ckpt.quantization, torch.float32, CPU, ref,
                       ckpt.config.pop("_rope_freq_factors", None), cpu=cpu)


def _tensors(obj: Any, path: str = "model", seen: set[int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor the model holds, by attribute path (packed planes, scales and zeros, int8 rows, floats)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, list | tuple):
        for i, x in enumerate(obj):
            yield from _tensors(x, f"{path}[{i}]", seen)
    elif isinstance(obj, torch.nn.Module) or type(obj).__module__.startswith("mlx_engine.backends.torch"):
        items = dict(vars(obj))
        if isinstance(obj, torch.nn.Module):
            items.update(obj.named_parameters(recurse=False), **dict(obj.named_buffers(recurse=False)))
        for name, x in sorted(items.items()):
            yield from _tensors(x, f"{path}.{name}", seen)


def _logits(model: Any) -> np.ndarray:
    with torch.inference_mode():
        h = model(torch.tensor([IDS]))
        return model.logits(h[0]).float().numpy()


@pytest.mark.parametrize("kind", [*GGUF_TYPES, "kquants", "mlx4", "float32", "bfloat16"])
def test_tensor_by_tensor_equals_the_eager_load_bit_for_bit(checkpoints, kind):
    ref = checkpoints[kind]
    eager, lazy = _build(ref, lazy=False), _build(ref, lazy=True)
    a, b = dict(_tensors(eager)), dict(_tensors(lazy))
    assert a.keys() == b.keys() and len(a) > 20
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    x, y = _logits(eager), _logits(lazy)
    assert np.abs(x).max() > 0 and np.array_equal(x, y)


class Recording(MutableMapping):
    """A checkpoint's weights, watched: at each `pop` (how build_model takes a tensor), how many arrays taken
    before are still alive (held by nobody, they are freed)."""

    def __init__(self, weights: MutableMapping):
        self.weights, self.taken, self.alive_at_pop = weights, [], []

    def pop(self, key: str, *default: Any) -> Any:
        self.alive_at_pop.append(sum(r() is not None for r in self.taken))
        if key not in self.weights:
            return default[0] if default else self.weights.pop(key)
        value = self.weights.pop(key)
        self.taken.append(weakref.ref(value))
        return value

    def __getitem__(self, key: str) -> Any:
        return self.weights[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.weights[key] = value

    def __delitem__(self, key: str) -> None:
        del self.weights[key]

    def __contains__(self, key: object) -> bool:
        return key in self.weights

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "kquants", "mlx4", "float32"])
def test_one_source_tensor_at_a_time(checkpoints, kind, monkeypatch):
    """GGUF: each tensor read once, only after the one before was taken whole, with no MLX memory left from it.
    Every format: when build_model takes a tensor, the arrays it took before are freed, but for the parts of
    one quantized matrix (weight, scales, biases) taken together."""
    reads: list[tuple[int, int]] = []
    read = GGUFTensors.read

    def counted(self: GGUFTensors, t: Any) -> None:
        reads.append((self.held, mx.get_active_memory()))
        read(self, t)

    monkeypatch.setattr(GGUFTensors, "read", counted)
    gc.collect()
    before = mx.get_active_memory()  # what earlier tests in this process still hold (module-scoped models)
    recorded: list[Recording] = []
    _build(checkpoints[kind], lazy=True, weights_wrapper=lambda w: recorded.append(Recording(w)) or recorded[0])
    alive = recorded[0].alive_at_pop
    assert len(alive) > 20 and max(alive) <= 2, alive
    if kind in ("mlx4", "float32"):
        assert not reads  # a folder: mx.load's arrays are read when evaluated
        return
    from mlx_engine.loading.gguf_file import read_gguf

    tensors = read_gguf(checkpoints[kind]).tensors
    assert len(reads) == len(tensors)
    assert all(held == 0 for held, _ in reads), reads
    largest = max(t.nbytes for t in tensors)
    assert max(active - before for _, active in reads) <= 4 * largest < sum(t.nbytes for t in tensors)


def test_the_runner_loads_tensor_by_tensor(checkpoints, monkeypatch):
    reads: list[int] = []
    read = GGUFTensors.read

    def counted(self: GGUFTensors, t: Any) -> None:
        reads.append(self.held)
        read(self, t)

    monkeypatch.setattr(GGUFTensors, "read", counted)
    with Engine.load(checkpoints["Q4_1"], backend="torch", device="cpu", compile=False) as engine:
        assert engine.info.backend == "torch"
    from mlx_engine.loading.gguf_file import read_gguf

    assert len(reads) == len(read_gguf(checkpoints["Q4_1"]).tensors) and set(reads) == {0}


def test_gguf_tensors_mapping():
    """The lazy mapping's own contract: names known before any read, `in` reads nothing, one read serves a
    quantized matrix's three parts, and a dropped name is gone."""
    ckpt = load_checkpoint(None, kquant_blocks=True, lazy=True)  # the embedded SmolLM2 (no tensor read yet)
    w = ckpt.weights
    assert isinstance(w, GGUFTensors) and w.held == 0
    assert "model.layers.0.self_attn.q_proj.scales" in w and "model.nothing" not in w and w.held == 0
    words = w.pop("model.layers.0.self_attn.q_proj.weight")
    assert w.held == 1 and words.dtype == mx.uint32
    w.pop("model.layers.0.self_attn.q_proj.scales"), w.pop("model.layers.0.self_attn.q_proj.biases")
    assert w.held == 0 and "model.layers.0.self_attn.q_proj.weight" not in w
    del w["model.layers.1.self_attn.q_proj.weight"]
    assert "model.layers.1.self_attn.q_proj.weight" not in w and w.held == 0
    with pytest.raises(KeyError):
        w["model.nothing"]
    with pytest.raises(TypeError, match="read from its file"):
        w["model.norm.weight"] = mx.zeros(3)
