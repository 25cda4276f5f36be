"""`roofline convert`: the folder it writes is mlx-lm's own format, so mlx-lm's own loader reads it and gives the
same logits as Roofline on that folder (float32); from a safetensors folder and from a GGUF file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.cli import one_line_error
from tests.support.tiny_models import GOLDEN, random_llama_folder, write_gguf_from_folder
from tests.support.tokenizer_files import write_tokenizer

ROOT = Path(__file__).resolve().parent.parent
IDS = [1, 5, 9, 17, 33, 65, 3, 7, 100, 4]
# the bound. Both sides dequantize the same packed weights and run float32 on the CPU: what is left is the
# order of float sums (MLX's quantized matmul against Roofline's host BLAS copies), measured 7e-6 to 1.5e-5 on
# logits of magnitude ~10 (AMD EPYC), so 6x headroom for other CPUs' code paths
LOGIT_TOL = 1e-4


def mlx_lm_logits(folder: Path) -> np.ndarray:
    """mlx-lm's own loader (`mlx_lm.utils.load_model`) and forward pass."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)
    return np.array(model(mx.array([IDS]))[0].astype(mx.float32))


def assert_same_logits(ours: np.ndarray, theirs: np.ndarray) -> None:
    maxdiff = float(np.abs(ours - theirs).max())
    print(f"roofline vs mlx-lm: maxdiff {maxdiff:.2e} (tolerance {LOGIT_TOL:.0e})")
    assert maxdiff < LOGIT_TOL


def roofline_logits(folder: Path) -> np.ndarray:
    from mlx_engine import Engine

    with Engine.load(str(folder), dtype="float32") as e:
        return e.forward_logits(IDS)


def convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", "convert", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("bits, group", [(4, 64), (8, 32)])
def test_from_a_safetensors_folder(tmp_path: Path, bits: int, group: int) -> None:
    src = write_tokenizer(random_llama_folder(tmp_path / "src", head_dim=64, hidden=128, seed=7))
    (src / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    out = tmp_path / "out"
    r = convert(str(src), "-o", str(out), "--bits", str(bits), "--group-size", str(group))
    assert r.returncode == 0, r.stderr
    assert "convert: quantizing" in r.stderr and f"wrote {out}" in r.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": group, "bits": bits, "mode": "affine"}
    assert config["quantization_config"] == config["quantization"]
    assert {"model.safetensors", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"} <= \
        {p.name for p in out.iterdir()}
    ours, theirs = roofline_logits(out), mlx_lm_logits(out)
    assert_same_logits(ours, theirs)
    # and it is the source, quantized: not equal to the float model, and close to it (a random tiny model's
    # logits reach +-9, so closeness is their correlation; measured 0.84 at 4 bits g64, 0.9994 at 8 bits g32)
    full = roofline_logits(src)
    assert np.abs(full - ours).max() > 1e-4
    assert np.corrcoef(full.ravel(), ours.ravel())[0, 1] > (0.75 if bits == 4 else 0.995)


def test_from_a_gguf_file(tmp_path: Path) -> None:
    gguf = tmp_path / "tiny-Q8_0.gguf"
    write_gguf_from_folder(GOLDEN / "llama", gguf, {}, "Q8_0")
    out = tmp_path / "out"
    r = convert(str(gguf), "-o", str(out), "--bits", "4", "--group-size", "32", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    ours, theirs = roofline_logits(out), mlx_lm_logits(out)
    assert_same_logits(ours, theirs)
    tok = json.loads((out / "tokenizer_config.json").read_text())  # rebuilt from the GGUF's metadata
    assert tok["tokenizer_class"] == "PreTrainedTokenizerFast" and tok["eos_token"]
    from mlx_engine.loading import load_tokenizer

    assert load_tokenizer(str(out)).encode("hi", add_special_tokens=False) == \
        load_tokenizer(str(gguf)).encode("hi", add_special_tokens=False)


def test_refusals_are_one_line(tmp_path: Path) -> None:
    out = tmp_path / "exists"
    out.mkdir()
    assert "already exists" in one_line_error(convert(str(GOLDEN / "llama"), "-o", str(out)))
    assert list(out.iterdir()) == []
    assert "does not exist" in one_line_error(convert(str(GOLDEN / "llama"), "-o", str(tmp_path / "no" / "out")))
    assert "model not found" in one_line_error(convert(str(tmp_path / "nothing"), "-o", str(tmp_path / "o")))
    r = convert(str(GOLDEN / "llama"), "-o", str(tmp_path / "o"), "--bits", "3")
    assert r.returncode == 2 and "invalid choice" in r.stderr
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.partial-*"))
