"""`roofline parity` on tiny random models: identical sides agree exactly, a perturbed layer is named, mismatched
tokenizers are one clear line; and `Runner.hidden_states` feeds `forward_logits`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.support.tiny_models import folder_with_weights, random_llama_folder
from tests.support.tokenizer_files import write_tokenizer

IDS = [[1, 5, 9, 17, 33, 65, 3, 7], [100, 4, 4, 27]]


def in_process(capsys: pytest.CaptureFixture, *args: str) -> subprocess.CompletedProcess:
    from app.cli import main

    rc = main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out.out, out.err)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("parity")
    base = random_llama_folder(tmp / "base", layers=3)
    w = load_file(str(base / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    perturbed = folder_with_weights(base, tmp / "perturbed", {name: w[name] + 0.5})
    prompts = tmp / "ids.jsonl"
    prompts.write_text("\n".join(json.dumps({"ids": i}) for i in IDS) + "\n")
    text_a = write_tokenizer(random_llama_folder(tmp / "text_a", layers=3))
    text_b = write_tokenizer(folder_with_weights(text_a, tmp / "text_b", {}), reverse=True)
    return {"base": base, "perturbed": perturbed, "prompts": prompts, "text_a": text_a, "text_b": text_b}


def test_same_model_on_both_sides_agrees_exactly(models: dict[str, Path], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "parity.json"
    r = in_process(capsys, "parity", "--model", str(models["base"]), "--backends", "mlx,mlx",
                   "--prompts", str(models["prompts"]), "--steps", "6", "--json", str(out))
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["schema"] == "roofline-parity-1" and [s["backend"] for s in report["sides"]] == ["mlx", "mlx"]
    assert [p["num_tokens"] for p in report["prompts"]] == [8, 4]
    for p in report["prompts"]:
        assert p["max_abs_logit_diff"] == 0.0 and p["top1_agreement"] == 1.0
        assert p["kl_mean"] == pytest.approx(0.0, abs=1e-12) and len(p["kl_per_position"]) == p["num_tokens"]
        assert p["tokens_identical"] and len(p["tokens_a"]) == 6 and p["tokens_a"] == p["tokens_b"]
        assert not p["diverged"] and p["first_diverging_layer"] is None
    assert not report["summary"]["diverged"]
    assert "OK: max |Δlogit| 0.00e+00" in r.stdout


def test_perturbed_layer_is_named(models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "parity.json"
    r = in_process(capsys, "parity", "--model", str(models["base"]), "--model-b", str(models["perturbed"]),
                   "--backends", "mlx,mlx", "--prompts", str(models["prompts"]), "--steps", "4", "--json", str(out))
    assert r.returncode == 1, r.stderr  # diverged
    report = json.loads(out.read_text())
    for p in report["prompts"]:
        assert p["diverged"] and p["kl_mean"] > 1e-3
        assert p["first_diverging_layer"]["name"] == "layer 1" and p["first_diverging_layer"]["index"] == 2
        rel = p["layer_rel_diffs"]
        assert rel[0] == 0.0 and rel[1] == 0.0 and rel[2] > 1e-2  # embedding and layer 0 untouched
    assert "first diverging hidden state: layer 1" in r.stdout and "DIVERGED" in r.stdout
    parted = [p for p in report["prompts"] if not p["tokens_identical"]]
    assert parted, "the perturbed layer should change some greedy token"
    from mlx_engine import Engine

    with Engine.load(str(models["base"])) as a, Engine.load(str(models["perturbed"])) as b:
        for p, ids in [(p, IDS[report["prompts"].index(p)]) for p in parted]:
            k, ta, tb = p["first_divergence_step"], p["tokens_a"], p["tokens_b"]
            la, lb = a.forward_logits(ids + ta[:k])[-1], b.forward_logits(ids + ta[:k])[-1]
            m = p["divergence_margins"]
            assert m["a"] == pytest.approx(float(la[ta[k]] - la[tb[k]]), abs=1e-5) and m["a"] >= 0
            assert m["b"] == pytest.approx(float(lb[tb[k]] - lb[ta[k]]), abs=1e-5) and m["b"] >= 0
    assert f"at step {parted[0]['first_divergence_step']}, A prefers its token by" in r.stdout


def test_a_divergence_at_a_tie_is_called_one() -> None:
    from app.parity_cmd import render

    side = {"backend": "mlx", "device": "cpu", "model": "m", "dtype": "float32"}
    prompt = {"num_tokens": 5, "max_abs_logit_diff": 0.075, "top1_agreement": 1.0, "kl_mean": 2e-5, "kl_max": 4e-5,
              "tokens_identical": False, "first_divergence_step": 2, "tokens_a": [1, 2, 3], "tokens_b": [1, 2, 4],
              "diverged": True, "reasons": ["greedy tokens differ from step 2"], "first_diverging_layer": None,
              "divergence_margins": {"a": 0.0151, "b": 0.0312, "logit": 39.07}}
    report = {"sides": [side, side], "settings": {"steps": 3}, "prompts": [prompt],
              "summary": {"diverged": True, "max_abs_logit_diff": 0.075, "min_top1_agreement": 1.0, "kl_mean": 2e-5,
                          "tokens_identical": False}}
    text = render(report)
    assert ("at step 2, A prefers its token by 0.0151 logits and B its own by 0.0312 (logits near 39.1): a tie "
            "within the logits' noise (7.50e-02)") in text
    prompt["divergence_margins"] = {"a": 2.5, "b": 0.0312, "logit": 39.07}
    assert "B its own by 0.0312 (logits near 39.1)\n" in render(report) + "\n" and "a tie" not in render(report)


def test_text_prompts_with_one_tokenizer_agree(models: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    r = in_process(capsys, "parity", "--model", str(models["text_a"]), "--backends", "mlx,mlx", "--steps", "2")
    assert r.returncode == 0, r.stderr
    assert "OK" in r.stdout and r.stdout.count("identical") >= 4  # the four built-in prompts


def test_mismatched_tokenizers_are_one_clear_line(models: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    r = in_process(capsys, "parity", "--model", str(models["text_a"]), "--model-b", str(models["text_b"]),
                   "--backends", "mlx,mlx", "--steps", "2")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "mismatched tokenizers" in r.stderr and "prompt 1" in r.stderr and "Traceback" not in r.stderr


def test_bad_parity_input_is_one_clear_line(models: dict[str, Path], tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    r = in_process(capsys, "parity", "--backends", "mlx")
    assert r.returncode == 2 and "--backends" in r.stderr
    r = in_process(capsys, "parity", "--prompts", str(tmp_path / "nope.txt"), "--backends", "mlx,mlx")
    assert r.returncode == 2 and "nope.txt: no such file" in r.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ids": "x"}\n')
    r = in_process(capsys, "parity", "--prompts", str(bad), "--backends", "mlx,mlx")
    assert r.returncode == 2 and "line 1" in r.stderr
    r = in_process(capsys, "parity", "--model", str(models["base"]), "--backends", "mlx,mlx")  # no tokenizer, text prompts
    assert r.returncode == 2 and "tokenizer" in r.stderr and '{"ids"' in r.stderr


def test_hidden_states_end_in_forward_logits(models: dict[str, Path]) -> None:
    from mlx_engine import Engine

    base = models["base"]
    w = load_file(str(base / "model.safetensors"))
    ids = IDS[0]
    with Engine.load(str(base)) as engine:
        hs = engine.hidden_states(ids)
        logits = engine.forward_logits(ids)
    assert len(hs) == 3 + 1 and all(h.shape == (len(ids), 64) and h.dtype == np.float32 for h in hs)
    np.testing.assert_array_equal(hs[0], w["model.embed_tokens.weight"][ids])
    h = hs[-1].astype(np.float64)
    normed = h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-5) * w["model.norm.weight"]  # RMSNorm
    np.testing.assert_allclose(normed @ w["lm_head.weight"].T, logits, atol=1e-4, rtol=1e-4)


def test_mlx_against_torch_on_cpu(models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from tests.support.torch_support import require

    require("torch")
    out = tmp_path / "parity.json"
    r = in_process(capsys, "parity", "--model", str(models["base"]), "--backends", "mlx,torch", "--device", "cpu",
                   "--prompts", str(models["prompts"]), "--steps", "6", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(out.read_text())
    assert report["sides"][1]["backend"] == "torch"
    for p in report["prompts"]:
        assert p["max_abs_logit_diff"] <= 1e-4 and p["top1_agreement"] == 1.0 and p["tokens_identical"]


def test_dtype_sets_the_torch_side(models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from tests.support.torch_support import require

    require("torch")
    out = tmp_path / "parity.json"
    r = in_process(capsys, "parity", "--model", str(models["base"]), "--backends", "mlx,torch", "--device", "cpu",
                   "--dtype", "bfloat16", "--prompts", str(models["prompts"]), "--steps", "2", "--json", str(out))
    report = json.loads(out.read_text())
    assert [s["dtype"] for s in report["sides"]] == ["float32", "bfloat16"], r.stdout
    assert 0 < report["summary"]["max_abs_logit_diff"] < 0.5  # bfloat16 rounding, not a broken model
    r = in_process(capsys, "parity", "--backends", "mlx,mlx", "--dtype", "float16")
    assert r.returncode == 2 and "--dtype float16" in r.stderr and "mlx,torch" in r.stderr
